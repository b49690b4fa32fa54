"""What Triton's OpenAI-compatible frontend reads to know a model's LoRA adapters, generated from adapter roots.

The frontend (`python3 openai_frontend/main.py --backend vllm --lora-separator _ ...`) lists and accepts adapter
names only for models whose version folder holds `model.json` with `"enable_lora": true` and `multi_lora.json`
mapping each adapter name to its path (vllm_backend's files). loom itself ignores both files: it finds adapters
under its `adapter_roots`. This module writes them from those roots so the two never disagree:

    python -m loom.serving.multi_lora model_repository/loom_smollm2            # write 1/model.json, 1/multi_lora.json
    python -m loom.serving.multi_lora model_repository/loom_smollm2 --check    # exit 1 if they are out of date

Paths in multi_lora.json are relative to the model folder when the adapter lies under it (the repository can
move), else absolute.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Sequence

from loom.errors import RequestError
from loom.lora.adapter_paths import resolve_adapter_path, validate_adapter_name

_ADAPTER_ROOTS = re.compile(r'key\s*:\s*"adapter_roots"\s*,?\s*value\s*:\s*\{\s*string_value\s*:\s*"([^"]*)"')


def adapter_roots_from_config(model_dir: str) -> list[str]:
    """The `adapter_roots` parameter of `<model_dir>/config.pbtxt`, relative paths resolved against model_dir."""
    with open(os.path.join(model_dir, "config.pbtxt")) as f:
        m = _ADAPTER_ROOTS.search(f.read())
    if m is None:
        return []
    roots = []
    for p in m.group(1).split(","):
        p = os.path.expandvars(os.path.expanduser(p.strip()))
        if p:
            roots.append(p if os.path.isabs(p) else os.path.normpath(os.path.join(model_dir, p)))
    return roots


def list_adapters(roots: Sequence[str]) -> dict[str, str]:
    """{name: real path} for every adapter folder directly under a root (first root wins a name), checked by the
    same rule that loads adapters (valid name, inside a root, no symlink escapes)."""
    found: dict[str, str] = {}
    for root in roots:
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            if name in found or not os.path.isfile(os.path.join(root, name, "adapter_config.json")):
                continue
            try:
                validate_adapter_name(name)
                found[name] = resolve_adapter_path(name, [root])
            except RequestError:
                continue  # not loadable by loom: not listed either
    return found


def manifest(model_dir: str, roots: Sequence[str] | None = None) -> dict[str, dict]:
    """{file name: content} for the model's version folder."""
    roots = adapter_roots_from_config(model_dir) if roots is None else list(roots)
    base = os.path.realpath(model_dir)
    lora = {}
    for name, path in list_adapters(roots).items():
        lora[name] = os.path.relpath(path, base) if path.startswith(base + os.sep) else path
    return {"model.json": {"enable_lora": bool(lora)}, "multi_lora.json": lora}


def _render(content: dict) -> str:
    return json.dumps(content, indent=2, sort_keys=True) + "\n"


def stale_files(model_dir: str, version: str = "1", roots: Sequence[str] | None = None) -> list[str]:
    """The files of `manifest` that are missing or differ in `<model_dir>/<version>/`."""
    out = []
    for fname, content in manifest(model_dir, roots).items():
        path = os.path.join(model_dir, version, fname)
        try:
            with open(path) as f:
                same = f.read() == _render(content)
        except FileNotFoundError:
            same = False
        if not same:
            out.append(path)
    return out


def write(model_dir: str, version: str = "1", roots: Sequence[str] | None = None) -> list[str]:
    os.makedirs(os.path.join(model_dir, version), exist_ok=True)
    paths = []
    for fname, content in manifest(model_dir, roots).items():
        path = os.path.join(model_dir, version, fname)
        with open(path, "w") as f:
            f.write(_render(content))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="a model folder of the repository (holding config.pbtxt)")
    ap.add_argument("--version", default="1", help="version folder (default 1)")
    ap.add_argument("--check", action="store_true", help="only check; exit 1 if the files are missing or stale")
    a = ap.parse_args(argv)
    if a.check:
        stale = stale_files(a.model_dir, a.version)
        for p in stale:
            print(f"out of date: {p} (run: python -m loom.serving.multi_lora {a.model_dir})")
        return 1 if stale else 0
    for p in write(a.model_dir, a.version):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

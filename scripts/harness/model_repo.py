"""A model repository for a test or a benchmark: a copy of a model folder with some config.pbtxt parameters set.

A parameter is one `{ key: "K", value: { string_value: "V" } }` entry of the config's `parameters [ ... ]` list
(docs/CONFIGURATION.md). `read_parameters` and `set_parameters` work on the config's text; `copy_model` copies a
model folder (by default the shipped model_repository/loom_smollm2, without its demo adapters) into a repository
folder under a name, with parameters set.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

SHIPPED_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
DEFAULT_MODEL = "loom_smollm2"

_PARAM_RE = re.compile(r'\{\s*key:\s*"([^"]+)"\s*,\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def read_parameters(config_text: str) -> dict[str, str]:
    """Every string parameter of a config.pbtxt: key -> value."""
    return dict(_PARAM_RE.findall(config_text))


def set_parameters(config_text: str, updates: dict[str, str]) -> str:
    """The config with each key of `updates` set: its entry's value replaced, or a new entry at the top of the
    `parameters` list (a new list at the end when the config has none)."""
    text = config_text
    for key, val in updates.items():
        pat = re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*,\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
        if pat.search(text):
            text = pat.sub(lambda m: m.group(1) + val + m.group(2), text)
        else:
            entry = f'  {{ key: "{key}", value: {{ string_value: "{val}" }} }}'
            text, k = re.subn(r"parameters\s*\[", lambda m: "parameters [\n" + entry + ",", text, count=1)
            if not k:
                text += f"\nparameters [\n{entry}\n]\n"
    return text


def copy_model(dest_repo: Path, params: dict[str, str] | None = None, *, name: str | None = None,
               src_repo: Path = SHIPPED_REPOSITORY, model: str = DEFAULT_MODEL, backend: str | None = None,
               keep_adapters: bool = False) -> Path:
    """Copy src_repo/model to dest_repo/name (default: the same name) -> the new model folder.

    params: config.pbtxt parameters to set. name: the model's name in the copy (its config's `name:` follows).
    backend: the backend that serves the copy (default: the source's). keep_adapters: also copy the model
    folder's `adapters` sub-folder (the shipped model's demo adapters), left out by default.
    """
    src = Path(src_repo) / model
    if not (src / "config.pbtxt").is_file():
        raise FileNotFoundError(f"{src}/config.pbtxt does not exist")
    name = name or model
    dest = Path(dest_repo) / name
    shutil.copytree(src, dest, ignore=None if keep_adapters else shutil.ignore_patterns("adapters"))
    cfg = dest / "config.pbtxt"
    text = cfg.read_text()
    if name != model:
        text = text.replace(f'name: "{model}"', f'name: "{name}"')
    if backend is not None:
        text = re.sub(r'backend:\s*"[^"]*"', f'backend: "{backend}"', text, count=1)
    cfg.write_text(set_parameters(text, params or {}))
    return dest

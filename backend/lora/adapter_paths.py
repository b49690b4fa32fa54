"""Where adapters may come from: the one rule (names, paths under the configured adapter roots, no symlink
escapes) that every load path goes through."""
from __future__ import annotations

import os
import re
from typing import Sequence

from loom.errors import RequestError
from loom.lora.peft_config import CONFIG_NAME, WEIGHTS_NAME

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._\-]*(?:/[A-Za-z0-9_][A-Za-z0-9._\-]*)*$")
MAX_NAME_LEN = 256


def validate_adapter_name(name, field_name: str = "lora_name") -> str:
    if not isinstance(name, str) or not name:
        raise RequestError(field_name, "adapter name must be a non-empty string")
    if len(name) > MAX_NAME_LEN or not _NAME_RE.match(name):
        raise RequestError(field_name, f"invalid adapter name {name!r}: use letters, digits, '.', '_', '-' "
                           f"(segments separated by '/', none starting with '.'), at most {MAX_NAME_LEN} characters")
    return name


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_adapter_path(path: str, roots: Sequence[str], field_name: str = "lora_path") -> str:
    """The real path of an adapter directory inside one of `roots`, or RequestError(field_name, ...).

    Relative paths are looked up under each root in order; absolute paths must lie inside a root.
    `..` components are refused outright; symlinks (of the directory or its files) may not leave the root.
    """
    if not roots:
        raise RequestError(field_name, "no adapter_roots are configured, so no adapter can be loaded")
    if not isinstance(path, str) or not path or "\0" in path:
        raise RequestError(field_name, "adapter path must be a non-empty string")
    if ".." in re.split(r"[\\/]+", path):
        raise RequestError(field_name, f"adapter path {path!r} may not contain '..'")
    real_roots = [os.path.realpath(r) for r in roots]
    if os.path.isabs(path):
        candidates = [path]
    else:
        candidates = [os.path.join(r, path) for r in real_roots]
    escaped = None
    for cand in candidates:
        real = os.path.realpath(cand)
        root = next((r for r in real_roots if _within(real, r)), None)
        if root is None:
            if os.path.isabs(path):
                raise RequestError(field_name, f"adapter path {path!r} is outside the configured adapter roots")
            if os.path.exists(cand):
                escaped = cand
            continue
        if not os.path.isdir(real):
            continue
        for fname in (CONFIG_NAME, WEIGHTS_NAME):
            f = os.path.join(real, fname)
            if os.path.lexists(f) and not _within(os.path.realpath(f), root):
                raise RequestError(field_name, f"{fname} of adapter path {path!r} links outside the adapter roots")
        return real
    if escaped is not None:
        raise RequestError(field_name, f"adapter path {path!r} resolves outside the configured adapter roots")
    raise RequestError(field_name, f"adapter directory {path!r} does not exist under the adapter roots")

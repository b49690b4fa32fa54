"""Where the default model (SmolLM2-135M-Instruct) lives. It is built once, offline, at set-up time by
`scripts/build_default_model.py` (the GGUF -> HF conversion is a tool, not part of the runtime)."""
from __future__ import annotations

import os
from pathlib import Path

from loom.errors import ConfigError

MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "LOOM_MODEL_CACHE"
# Files that make a complete model folder.
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json")

_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_model_dir() -> Path:
    """`$LOOM_MODEL_CACHE/SmolLM2-135M-Instruct`, else `<checkout>/.cache/models/...`, else `~/.cache/loom/models/...`
    (it may not be built yet)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        root = Path(env).expanduser()
    elif (_REPO_ROOT / "pyproject.toml").is_file():
        root = _REPO_ROOT / ".cache" / "models"
    else:  # installed outside a checkout
        root = Path.home() / ".cache" / "loom" / "models"
    return root / MODEL_NAME


def is_built(path: Path | None = None) -> bool:
    path = Path(path) if path is not None else default_model_dir()
    return all((path / name).is_file() for name in REQUIRED_FILES)


def resolve_default_model() -> str:
    """The built default model's folder, or a ConfigError saying how to build it."""
    path = default_model_dir()
    if not is_built(path):
        raise ConfigError("model", f"no model was given and the default model is not built at {path}: run "
                          f"`python scripts/build_default_model.py` (or scripts/setup.sh), or set {CACHE_ENV}")
    return str(path)

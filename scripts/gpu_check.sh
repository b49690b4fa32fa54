#!/usr/bin/env bash
# The one command for a GPU machine with no network and no venv (the device machine): make `import loom` work,
# then run the check. Any gpu_check.py arguments pass through:
#     bash scripts/gpu_check.sh --out "$OUT"
# Wall time: the install (seconds) + gpu_check's budget of 450 s (7.5 min) at most, by construction: with ~3 min of
# machine start that leaves ~4 min of a 15-minute GPU slot to rerun what failed (--sections NAME), whose Triton
# kernels are then loaded from the cache this script keeps in results/triton_cache (not under --out: it would be
# copied back with the results; pass --triton-cache to put it elsewhere).
# 1. An editable install with the machine's own setuptools (pyproject maps loom -> backend/, loom.kernels ->
#    kernels/; setuptools >= 64 for editable installs). 2. If that fails (setuptools missing or too old): a
#    folder whose loom/ holds links to backend/* and kernels/, put first on PYTHONPATH. Both need no network.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import loom.kernels" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"${TMPDIR:-/tmp}/loom_pip_install.log" 2>&1 ||
    echo "pip install -e . failed (${TMPDIR:-/tmp}/loom_pip_install.log): using the link folder instead"
fi
if ! "$PY" -c "import loom.kernels" 2>/dev/null; then
  links=$(mktemp -d)
  mkdir "$links/loom"
  for f in "$PWD"/backend/*; do ln -s "$f" "$links/loom/"; done
  ln -s "$PWD/kernels" "$links/loom/kernels"
  export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import loom.kernels" || { echo "cannot make loom importable" >&2; exit 3; }
fi
export PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py --triton-cache "$PWD/results/triton_cache" "$@"

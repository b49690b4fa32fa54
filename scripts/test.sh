#!/usr/bin/env bash
# The test command (README): set up what is missing (venv, packages, default model), lint, then run pytest.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# ruff comes with the test extras (pyproject.toml); a lint error fails the run before any test starts.
.venv/bin/ruff check .
# pyproject's addopts -ra lists every skip with its reason (a kernel build this CPU cannot run names the flags it lacks)
exec .venv/bin/python -m pytest -q "$@"

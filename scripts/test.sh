#!/usr/bin/env bash
# The test command (README): set up what is missing (venv, packages, default model), then run pytest.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"

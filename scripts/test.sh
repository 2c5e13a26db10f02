#!/usr/bin/env bash
# Set up the environment, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m pytest -q "$@"

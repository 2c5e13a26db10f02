#!/usr/bin/env bash
# Set up the environment, then run the whole test suite on every core. Extra arguments go to pytest.
#
# pytest-xdist runs one worker per core (POLYKV_TEST_WORKERS overrides: a number, or 0 for one process);
# each worker uses one torch thread (tests/conftest.py), so the workers do not fight over the cores.
# --dist loadgroup keeps the tests that share one local Ray on one worker. `-n 0` among the extra
# arguments also runs everything in this one process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m pytest -q -n "${POLYKV_TEST_WORKERS:-auto}" --dist loadgroup "$@"

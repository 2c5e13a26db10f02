#!/usr/bin/env bash
# Set up the environment, then run the demo on the default model. Extra arguments go to `polykv demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec polykv demo "$@"

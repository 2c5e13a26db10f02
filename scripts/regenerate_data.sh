#!/usr/bin/env bash
# Regenerate the shipped data for SmolLM2-135M-Instruct: the calibration profile (+ TriAttention query
# statistics beside it) and the plans at 4x and 8x compression. See docs/calibration.md.
#
#   bash scripts/regenerate_data.sh            # everything (about 25 minutes on 2 CPU cores)
#   PLANS_ONLY=1 bash scripts/regenerate_data.sh   # plans only, from the existing profile
#
# An interrupted calibration resumes from profiles/<name>.profile.json.partial/ when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi

NAME=smollm2-135m-instruct
PROFILE=profiles/$NAME.profile.json
CONTEXT=${CONTEXT:-4096}   # context length (tokens) the plan budgets refer to

if [ -z "${PLANS_ONLY:-}" ]; then
  # MoE-nD design space (keep x K bits x V bits) for every registered rule, 8 sequences of 640 tokens
  # (prefix 512 compressed, 128 follow-up queries); PolyKV delta-PPL on 1 sequence; KL validation of
  # 6 sampled configs per layer on 1 held-out sequence.
  polykv calibrate default -o "$PROFILE" --sequences 8 --tokens 640 --prefix 512 --seed 0 \
    --delta-ppl 1 --validate 1 --validate-configs 6 --no-progress
fi

solve() {  # solve BUDGET OUTPUT-STEM SOLVER [--param K=V ...]
  local budget=$1 stem=$2 solver=$3; shift 3
  polykv solve "$PROFILE" --budget "$budget" --context "$CONTEXT" --solver "$solver" "$@" \
    -o "plans/$NAME.$stem.$budget.plan.json"
}

mkdir -p plans
for B in 4x 8x; do
  solve "$B" exact exact
  solve "$B" moend-greedy-triattention moend-greedy --param rule=triattention
  solve "$B" moend-greedy-snapkv moend-greedy --param rule=snapkv
  solve "$B" uniform-best uniform
  solve "$B" uniform-1d uniform --param mode=1d
  solve "$B" uniform-2d uniform --param mode=2d_uniform
  solve "$B" quant-only-triattention quant-only --param rule=triattention
  solve "$B" route-prefill profile-route --param scope=prefill
  solve "$B" route-prefill-entropy profile-route --param scope=prefill --param allocation=entropy
  solve "$B" route-prefill-delta-ppl profile-route --param scope=prefill --param allocation=delta-ppl
done

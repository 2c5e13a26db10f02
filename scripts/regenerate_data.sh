#!/usr/bin/env bash
# Regenerate the shipped data for SmolLM2-135M-Instruct: the calibration profile (+ TriAttention query
# statistics beside it) and the plans at 4x and 8x compression, on the resident basis (real bytes) and,
# under names ending in -nominal, on MoE-nD's nominal basis. See docs/calibration.md.
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

solve() {  # solve BASIS BUDGET OUTPUT-STEM SOLVER [--param K=V ...]
  local basis=$1 budget=$2 stem=$3 solver=$4; shift 4
  local suffix=""
  if [ "$basis" = nominal ]; then suffix="-nominal"; fi
  polykv solve "$PROFILE" --budget "$budget" --context "$CONTEXT" --basis "$basis" --solver "$solver" "$@" \
    -o "plans/$NAME.$stem.$budget$suffix.plan.json"
}

# Resident plans (plans/<name>.<solver>.<budget>.plan.json): budgets count the bytes the runtime holds
# (codes, scales, residuals, positions; bfloat16 storage, batch 1), so "8x" holds 1/8 of a 16-bit cache.
# Nominal plans (...<budget>-nominal.plan.json): MoE-nD's codes-only bytes, for comparison with the paper.
# Every capacity is written as a ratio of the context, so a plan keeps its compression at any length.
mkdir -p plans
for BASIS in resident nominal; do
  for B in 4x 8x; do
    solve $BASIS "$B" exact exact
    solve $BASIS "$B" moend-greedy-triattention moend-greedy --param rule=triattention
    solve $BASIS "$B" moend-greedy-snapkv moend-greedy --param rule=snapkv
    solve $BASIS "$B" uniform-best uniform
    solve $BASIS "$B" uniform-1d uniform --param mode=1d
    solve $BASIS "$B" uniform-2d uniform --param mode=2d_uniform
    solve $BASIS "$B" quant-only-triattention quant-only --param rule=triattention
    solve $BASIS "$B" route-prefill profile-route --param scope=prefill
    solve $BASIS "$B" route-prefill-entropy profile-route --param scope=prefill --param allocation=entropy
    solve $BASIS "$B" route-prefill-delta-ppl profile-route --param scope=prefill --param allocation=delta-ppl
  done
done

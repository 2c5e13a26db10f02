#!/usr/bin/env bash
# Regenerate the shipped data for SmolLM2-135M-Instruct: the calibration profile (+ TriAttention query
# statistics beside it) and the plans at 4x and 8x compression, on the resident basis (real bytes) and,
# under names ending in -nominal, on MoE-nD's nominal basis. See docs/calibration.md.
#
#   bash scripts/regenerate_data.sh                # profile over every registered rule, then the plans
#   FULL_STATS=1 bash scripts/regenerate_data.sh   # also delta-PPL and KL validation (+ the delta-ppl plans)
#   PLANS_ONLY=1 bash scripts/regenerate_data.sh   # plans only, from the existing profile
#
# Timings (docs/calibration.md): the 13-rule design space took 46 min wall (505 s CPU) on the busy shared
# 2-core machine; delta-PPL costs one whole-model forward per (layer, rule), about 1 hour more there.
#
# An interrupted calibration resumes from profiles/<name>.profile.json.partial/ when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi

NAME=smollm2-135m-instruct
PROFILE=profiles/$NAME.profile.json
CONTEXT=${CONTEXT:-4096}   # context length (tokens) the plan budgets refer to

if [ -z "${PLANS_ONLY:-}" ]; then
  # MoE-nD design space (keep x K bits x V bits) for every registered rule (wrappers around their
  # default inner rule), 8 sequences of 640 tokens (prefix 512 compressed, 128 follow-up queries);
  # with FULL_STATS=1 also PolyKV delta-PPL on 1 sequence and KL validation of 6 sampled configs per
  # layer on 1 held-out sequence.
  EXTRA=()
  if [ -n "${FULL_STATS:-}" ]; then EXTRA=(--delta-ppl 1 --validate 1 --validate-configs 6); fi
  polykv calibrate default -o "$PROFILE" --sequences 8 --tokens 640 --prefix 512 --seed 0 --threads 1 \
    "${EXTRA[@]}" --no-progress
  # Which parameters (and inner rules) the calibrated rules ran with, into the profile's provenance note.
  python scripts/note_profile_rules.py "$PROFILE"
fi

# The delta-ppl route needs the profile's delta_ppl statistic (FULL_STATS=1); without it those plans
# are not solved, and stale ones (from another profile) are removed so every shipped plan is this
# profile's.
HAS_DELTA_PPL=$(python -c "import sys; from polykv.profiling.profile import load_profile; \
print(int('delta_ppl' in load_profile(sys.argv[1]).stats))" "$PROFILE")

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
    if [ "$HAS_DELTA_PPL" = 1 ]; then
      solve $BASIS "$B" route-prefill-delta-ppl profile-route --param scope=prefill --param allocation=delta-ppl
    else
      rm -f "plans/$NAME.route-prefill-delta-ppl.$B$([ "$BASIS" = nominal ] && echo -nominal).plan.json"
    fi
  done
done

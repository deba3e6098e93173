#!/usr/bin/env bash
# On-policy distillation against plain GRPO on SmolLM2-135M-Instruct (issue 47), the `lists` task
# of bench/real_ab.py (sums and integer ranges, graded exactly, 200 held-out prompts).
#
# 1. The teacher: one sync GRPO run of the preset (seed 0), saved at its last step: a copy of the
#    student's base model that knows the task better.
# 2. The students, seeds 1..3, sync, three at a time on one GPU (accuracy only: the speed columns
#    of runs sharing a GPU are not a speed comparison; six at once ran out of memory as their
#    engines started together), each STEPS steps (default 20: by step 50 plain GRPO reaches the
#    teacher's own level, where the teacher has nothing left to teach): `grpo` (the defaults) and
#    `opd` (the same, plus the teacher in the trainer, --opd-type megatron, its per-token reverse
#    KL added to the task's advantage with --opd-kl-coef, default 1.0).
#
#     PYTHONPATH=. bash bench/opd_ab.sh                         # one H200: ~5 minutes
#     TEACHER_STEPS=1 STEPS=1 SMOKE="--eval-limit 4 --batch 2 --n-samples 2" PYTHONPATH=. bash bench/opd_ab.sh   # CPU smoke
#
# Tables: $OPD_OUT/students/real_ab.md (each seed's held-out change, the mean over seeds, the
# accuracy at every 5th step). A finished run is not run again (real_ab.py), so a rerun with more
# seeds adds only those.
set -euo pipefail
OUT=${OPD_OUT:-/tmp/vime-opd}
TEACHER_STEPS=${TEACHER_STEPS:-50}
STEPS=${STEPS:-20}
SMOKE=${SMOKE:-}
SEEDS=${SEEDS:-1,2,3}
PARALLEL=${PARALLEL:-3}
PY=${PYTHON:-python3}
# shellcheck disable=SC2086
"$PY" bench/real_ab.py --preset lists --arms sync --seeds 0 --steps "$TEACHER_STEPS" $SMOKE \
    --out "$OUT/teacher" --arm-args "--save $OUT/teacher-ckpt"
# shellcheck disable=SC2086
"$PY" bench/real_ab.py --preset lists --arms sync --seeds "$SEEDS" --steps "$STEPS" $SMOKE \
    --parallel "$PARALLEL" --out "$OUT/students" \
    --variants "grpo=;opd=--use-opd --opd-type megatron --opd-teacher-load $OUT/teacher-ckpt"

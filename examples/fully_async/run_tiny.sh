#!/usr/bin/env bash
# Fully-async GRPO on the tiny random model, CPU only, about ten seconds.
# Run from the repository root:  bash examples/fully_async/run_tiny.sh [extra flags]
# Extra flags are appended, so they override the ones below (e.g. --run-name mine).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}

"$PYTHON" train_async.py --config examples/tiny.yaml \
    --rollout-function-path vime.rollout.fully_async_rollout.generate_rollout_fully_async \
    --num-rollout 5 \
    --rollout-concurrency 8 \
    --eval-interval 5 \
    --device cpu \
    --run-name "${RUN_NAME:-tiny-fully-async-$(date +%Y%m%d-%H%M%S)}" \
    "$@"

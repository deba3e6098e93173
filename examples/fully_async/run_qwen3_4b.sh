#!/usr/bin/env bash
# GRPO on Qwen3-4B (or any HF causal-LM directory of that size) on one machine with two GPUs:
# GPU 0 trains, GPU 1 runs the rollout engine.
#
#   bash examples/fully_async/run_qwen3_4b.sh /path/to/Qwen3-4B [extra flags]
#   MODEL_DIR=/path/to/Qwen3-4B ARM=sync bash examples/fully_async/run_qwen3_4b.sh
#
# ARM picks the training mode, so the same settings can be run once per arm and compared:
#   fully-async (default) | one-step-off | sync | decoupled (MAX_STALENESS, default 2, with TIS)
# Other knobs: DATA_DIR (default data/gsm_symbolic, written by `vime data` if missing),
# NUM_ROLLOUT (default 100), RUN_NAME, CKPT_DIR, PYTHON.
# Extra flags after the model directory are appended and override the ones below.
#
# Status: written against vime's flags but not yet run end to end by us on a 4B model.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ $# -ge 1 && $1 != --* ]]; then MODEL_DIR=$1; shift; fi
: "${MODEL_DIR:?give the Qwen3-4B HF directory as the first argument or in MODEL_DIR}"
PYTHON=${PYTHON:-python}
ARM=${ARM:-fully-async}
DATA_DIR=${DATA_DIR:-data/gsm_symbolic}
NUM_ROLLOUT=${NUM_ROLLOUT:-100}
RUN_NAME=${RUN_NAME:-qwen3-4b-$ARM-$(date +%Y%m%d-%H%M%S)}
CKPT_DIR=${CKPT_DIR:-checkpoints/$RUN_NAME}

if [[ ! -f $DATA_DIR/train.jsonl ]]; then
    "$PYTHON" -m vime.cli data --task gsm_symbolic --out "$DATA_DIR" --n-train 2000 --n-test 200 --seed 0
fi

case $ARM in
    sync)         ENTRY=(train.py) ;;
    one-step-off) ENTRY=(train_async.py) ;;
    fully-async)  ENTRY=(train_async.py --rollout-function-path vime.rollout.fully_async_rollout.generate_rollout_fully_async) ;;
    decoupled)    ENTRY=(train_async.py --max-staleness "${MAX_STALENESS:-2}" --use-tis --tis-clip 2.0) ;;
    *) echo "ARM must be sync, one-step-off, fully-async or decoupled (got '$ARM')" >&2; exit 2 ;;
esac

"$PYTHON" "${ENTRY[@]}" \
    --hf-checkpoint "$MODEL_DIR" \
    --prompt-data "$DATA_DIR/train.jsonl" \
    --apply-chat-template --apply-chat-template-kwargs '{"enable_thinking": false}' \
    --rm-type math \
    --num-rollout "$NUM_ROLLOUT" \
    --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32 \
    --rollout-max-response-len 1024 --rollout-temperature 1.0 --rollout-shuffle \
    --lr 1e-6 --gradient-checkpointing \
    --device cuda --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
    --eval-interval 20 --eval-prompt-data "$DATA_DIR/test.jsonl" --eval-limit 200 \
    --save "$CKPT_DIR" --save-interval 50 \
    --run-name "$RUN_NAME" \
    "$@"

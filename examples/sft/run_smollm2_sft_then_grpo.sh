#!/usr/bin/env bash
# SFT warm start, then GRPO from its checkpoint, on the embedded SmolLM2-135M-Instruct (CPU is
# enough; a few minutes). The SFT flags are slime's SFT script's (scripts/run-qwen3-4B-base-sft.sh)
# with vime's module path; no engine starts for the SFT part.
# Run from the repository root:  bash examples/sft/run_smollm2_sft_then_grpo.sh [extra SFT flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-runs/sft-example}
SFT_STEPS=${SFT_STEPS:-16}

"$PYTHON" -m vime data --task addition --digits 2 --out "$OUT/data" --n-train 256 --n-test 64 --seed 0
"$PYTHON" examples/sft/to_conversations.py "$OUT/data/train.jsonl" "$OUT/data/sft.jsonl"

SFT_ARGS=(
   --rollout-function-path vime.rollout.sft_rollout.generate_rollout
   --prompt-data "$OUT/data/sft.jsonl"
   --input-key messages
   --rollout-shuffle
   --num-rollout "$SFT_STEPS"
   --rollout-batch-size 16
   --global-batch-size 16

   --loss-type sft_loss
   --calculate-per-token-loss
   --disable-compute-advantages-and-returns
   --debug-train-only
)
OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-5
   --lr-decay-style cosine
   --min-lr 1e-6
   --lr-warmup-fraction 0.1
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.95
)

"$PYTHON" train_async.py --hf-checkpoint smollm2 "${SFT_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
    --save "$OUT/sft-ckpt" --save-interval "$SFT_STEPS" --runs-dir "$OUT" --run-name sft "$@"

# RL from the SFT model: its checkpoint is an HF directory (weights, tokenizer, chat template)
"$PYTHON" train.py --hf-checkpoint "$OUT/sft-ckpt/$SFT_STEPS" --prompt-data "$OUT/data/train.jsonl" \
    --apply-chat-template --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout 4 \
    --rollout-max-response-len 16 --lr 1e-6 \
    --eval-prompt-data "$OUT/data/test.jsonl" --eval-interval 4 --eval-limit 32 \
    --runs-dir "$OUT" --run-name grpo

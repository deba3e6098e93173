#!/bin/bash
# GRPO with vllm-project/vime's train/inference mismatch helper: its examples/train_infer_mismatch_helper
# run script, flag for flag, on vime. vllm-project/vime's mis.py (--custom-tis-function-path) weighs each
# token's policy-gradient loss by its importance ratio π_trainer/π_rollout, bounded as its
# mis.yaml says (--custom-config-path), drops sequences by rejection sampling, and logs the
# mismatch metrics (train/mis_*).
# Paths come from the environment:
#   SEED_EXAMPLE_DIR  vllm-project/vime's examples/train_infer_mismatch_helper directory (mis.py, mis.yaml;
#                     mis.py is loaded as `examples.train_infer_mismatch_helper.mis`, so the
#                     directory's parent's parent goes on PYTHONPATH)
#   MODEL_DIR         an HF model directory (default /root/Qwen3-4B)
#   DATA_PATH         dapo-math-17k as JSONL: `prompt` (chat messages) and `label`
#   EVAL_DATA         the held-out set (default /root/aime-2024/aime-2024.jsonl)
#   CKPT_DIR          where checkpoints go (default /root/Qwen3-4B_vime/)
#   MODEL_SHAPE       which scripts/models/<name>.sh describes MODEL_DIR (default qwen3-4B)
#   GPUS              GPUs, shared by trainer and engines (--colocate, as vllm-project/vime ran it; default 8)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
# vllm-project/vime's W&B flags (--use-wandb --wandb-project vime-mis --wandb-group qwen3-4B-mis
# --wandb-key) work the same; add them at the end with your key.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen3-4B}.sh"

: "${SEED_EXAMPLE_DIR:?set SEED_EXAMPLE_DIR to the examples/train_infer_mismatch_helper directory of vllm-project/vime}"
SEED_ROOT="$(cd -- "${SEED_EXAMPLE_DIR}/../.." &>/dev/null && pwd)"
export PYTHONPATH="${SEED_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
MODEL_DIR=${MODEL_DIR:-/root/Qwen3-4B}
DATA_PATH=${DATA_PATH:-/root/dapo-math-17k/dapo-math-17k.jsonl}
EVAL_DATA=${EVAL_DATA:-/root/aime-2024/aime-2024.jsonl}
CKPT_DIR=${CKPT_DIR:-/root/Qwen3-4B_vime/}
GPUS=${GPUS:-8}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}_torch_dist"   # not read: --kl-loss-coef 0 needs no reference model
   --save "${CKPT_DIR}"
   --save-interval 200
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size 256
   --balance-data
)

# as in vllm-project/vime, the set is named but --eval-interval is left off: no evaluation runs
EVAL_ARGS=(
   --eval-prompt-data aime "${EVAL_DATA}"
   --n-samples-per-eval-prompt 1
   --eval-max-response-len 16384
   --eval-top-p 1
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 2            # vime splits no sequence over GPUs: said at start-up, as 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
   --use-tis
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

VLLM_ARGS=(
   --rollout-num-gpus-per-engine 1
   --vllm-gpu-memory-utilization 0.7
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

CUSTOM_ARGS=(
   --custom-config-path "${SEED_EXAMPLE_DIR}/mis.yaml"
   --custom-tis-function-path examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp
)

exec "${PYTHON:-python3}" "${VIME_ROOT}/train.py" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${GPUS}" \
   --colocate \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${EVAL_ARGS[@]}" \
   "${VLLM_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${CUSTOM_ARGS[@]}" \
   "$@"

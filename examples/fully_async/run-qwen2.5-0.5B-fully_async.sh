#!/bin/bash
# Fully-async GRPO on Qwen2.5-0.5B-Instruct with dapo-math-17k: vllm-project/vime's example of the
# same name, flag for flag, running on vime. Paths come from the environment:
#   MODEL_DIR    an HF model directory (default /root/models/Qwen2.5-0.5B-Instruct)
#   DATA_PATH    dapo-math-17k as JSONL: `prompt` (chat messages) and `label`
#   MODEL_SHAPE  which scripts/models/<name>.sh describes MODEL_DIR (default qwen2.5-0.5B)
#   ACTOR_GPUS / ROLLOUT_GPUS  trainer and engine GPUs (default 1 and the rest; on CPU both run here)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
# vllm-project/vime started this as `ray job submit ... -- python3 train_async.py ...`, which works the same
# (docs/slime-flags.md); on one machine vime needs no Ray.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen2.5-0.5B}.sh"

MODEL_DIR=${MODEL_DIR:-/root/models/Qwen2.5-0.5B-Instruct}
DATA_PATH=${DATA_PATH:-/root/datasets/dapo-math-17k/dapo-math-17k.jsonl}
NUM_GPUS=${NUM_GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
ACTOR_GPUS=${ACTOR_GPUS:-1}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-$((NUM_GPUS > ACTOR_GPUS ? NUM_GPUS - ACTOR_GPUS : 1))}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}_torch_dist"   # not read: --kl-loss-coef 0 needs no reference model
   --save /tmp/vime_fully_async_demo/
   --save-interval 9999
)

ROLLOUT_ARGS=(
   --rollout-function-path vime.rollout.fully_async_rollout.generate_rollout_fully_async
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3
   --rollout-batch-size 8
   --n-samples-per-prompt 4
   --rollout-max-response-len 1024
   --rollout-temperature 1
   --global-batch-size 32
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 4096
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
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
   --vllm-gpu-memory-utilization 0.55
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

exec "${PYTHON:-python3}" "${VIME_ROOT}/train_async.py" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${ACTOR_GPUS}" \
   --rollout-num-gpus "${ROLLOUT_GPUS}" \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${VLLM_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "$@"

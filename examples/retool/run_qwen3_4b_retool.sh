#!/bin/bash
# ReTool RL on Qwen3-4B (an SFT checkpoint with a Python tool): vllm-project/vime's
# examples/retool/retool_qwen3_4b_rl.sh, flag for flag, running vllm-project/vime's own Python files
# (generate_with_retool.py, tool_sandbox.py) on vime. Paths come from the environment:
#   SEED_EXAMPLE_DIR  vllm-project/vime's examples/retool folder (its Python files are imported from it)
#   MODEL_DIR         an HF model directory (default /root/font-info/qwen3-4b-sft)
#   DATA_PATH         dapo-math-17k as JSONL: `prompt` (text) and `label`
#   EVAL_DATA_PATH    aime-2024 as JSONL (default /root/aime-2024/aime-2024.jsonl)
#   CKPT_DIR          where checkpoints go (default ${MODEL_DIR}/qwen3-4b-sft-multi-turn/)
#   MODEL_SHAPE       which scripts/models/<name>.sh describes MODEL_DIR (default qwen3-4B)
#   ACTOR_GPUS        trainer GPUs, colocated with the engines (default 4)
#   ENTRY             train.py (vllm-project/vime's, default) or train_async.py (then add the fully-async
#                     rollout function and drop --colocate: see README.md)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
# vllm-project/vime started this through `ray job submit`; on one machine vime needs no Ray.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
: "${SEED_EXAMPLE_DIR:?set SEED_EXAMPLE_DIR to vllm-project/vime\'s examples/retool folder}"
# ReTool's SFT checkpoint uses rope theta 5e6, not qwen3-4B.sh's 1e6 default (vllm-project/vime's own note)
MODEL_ARGS_ROTARY_BASE=${MODEL_ARGS_ROTARY_BASE:-5000000} source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen3-4B}.sh"

MODEL_DIR=${MODEL_DIR:-/root/font-info/qwen3-4b-sft}
DATA_PATH=${DATA_PATH:-/root/dapo-math-17k/dapo-math-17k.jsonl}
EVAL_DATA_PATH=${EVAL_DATA_PATH:-/root/aime-2024/aime-2024.jsonl}
CKPT_DIR=${CKPT_DIR:-${MODEL_DIR}/qwen3-4b-sft-multi-turn/}
ACTOR_GPUS=${ACTOR_GPUS:-4}
export PYTHONPATH="${SEED_EXAMPLE_DIR}:${VIME_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}_torch_dist"   # not read: --kl-loss-coef 0 needs no reference model
   --save "${CKPT_DIR}"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --label-key label
   # no --apply-chat-template: generate_with_retool renders the whole conversation itself
   --rollout-shuffle
   --reward-key score
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size 256
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime "${EVAL_DATA_PATH}"
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 1
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
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
   --rollout-num-gpus-per-engine 2
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
   --custom-generate-function-path generate_with_retool.generate
   --custom-rm-path generate_with_retool.reward_func
)

# vllm-project/vime's --use-wandb block, when WANDB_KEY is set
WANDB_ARGS=()
if [ -n "${WANDB_KEY:-}" ]; then
   WANDB_ARGS=(--use-wandb --wandb-project vime-dapo --wandb-group qwen3-4B-test-multi-turn --wandb-key "${WANDB_KEY}")
fi

ENTRY=${ENTRY:-train.py}
COLOCATE=(--colocate)
[ "${ENTRY}" = train.py ] || COLOCATE=()

exec "${PYTHON:-python3}" "${VIME_ROOT}/${ENTRY}" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${ACTOR_GPUS}" \
   "${COLOCATE[@]}" \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${WANDB_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${EVAL_ARGS[@]}" \
   "${VLLM_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${CUSTOM_ARGS[@]}" \
   "$@"

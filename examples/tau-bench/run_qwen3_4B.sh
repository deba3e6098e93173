#!/bin/bash
# tau-bench (retail) on Qwen3-4B-Instruct-2507: vllm-project/vime's examples/tau-bench/run_qwen3_4B.sh,
# flag for flag, running vllm-project/vime's own Python files (generate_with_tau.py, trainable_agents.py,
# openai_tool_adapter.py, vllm_tool_parser.py, token_delta.py) on vime. They import the
# `tau_bench` package (github.com/JD-ETH/tau-bench, installed with `pip install -e . --no-deps`), or
# examples/tau-bench/standin on PYTHONPATH (a toy shop: what README.md's run used). Paths come from the environment:
#   SEED_EXAMPLE_DIR  vllm-project/vime's examples/tau-bench folder (its Python files are imported from it)
#   MODEL_DIR         an HF model directory (default /root/Qwen3-4B-Instruct-2507/)
#   DATA_DIR          where tau1_mock.py wrote retail_{train,dev}_tasks.jsonl (default /root/tau-bench)
#   CKPT_DIR          checkpoints; a rerun resumes from the newest (default /root/Qwen3-4B-Instruct-2507_vime/)
#   MODEL_SHAPE       which scripts/models/<name>.sh describes MODEL_DIR (default qwen3-4B, rope base 5e6)
#   NUM_GPUS          trainer and engine GPUs, colocated (default 2, as vllm-project/vime's)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
: "${SEED_EXAMPLE_DIR:?set SEED_EXAMPLE_DIR to vllm-project/vime\'s examples/tau-bench folder}"
# Qwen3-4B-Instruct-2507 is Qwen3-4B's shape with rope base 5e6
MODEL_ARGS_ROTARY_BASE=${MODEL_ARGS_ROTARY_BASE:-5000000} source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen3-4B}.sh"

MODEL_DIR=${MODEL_DIR:-/root/Qwen3-4B-Instruct-2507/}
DATA_DIR=${DATA_DIR:-/root/tau-bench}
CKPT_DIR=${CKPT_DIR:-/root/Qwen3-4B-Instruct-2507_vime/}
NUM_GPUS=${NUM_GPUS:-2}
export PYTHONPATH="${SEED_EXAMPLE_DIR}:${VIME_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR%/}_torch_dist/"   # not read: --kl-loss-coef 0 needs no reference model
   --load "${CKPT_DIR}"
   --save "${CKPT_DIR}"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_DIR}/retail_train_tasks.jsonl"
   --input-key index                     # the task's number: the generate builds the conversation
   --rollout-shuffle
   --num-rollout 500
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 1024
   --rollout-temperature 1
   --global-batch-size 256
   --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 5
   --eval-prompt-data retail-dev "${DATA_DIR}/retail_dev_tasks.jsonl"
   --n-samples-per-eval-prompt 1
   --eval-max-response-len 1024
   --eval-top-k 1
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
   --custom-generate-function-path generate_with_tau.generate
)

exec "${PYTHON:-python3}" "${VIME_ROOT}/train.py" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${NUM_GPUS}" \
   --rollout-num-gpus "${NUM_GPUS}" \
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

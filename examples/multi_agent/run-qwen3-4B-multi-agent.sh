#!/bin/bash
# Multi-agent GRPO on dapo-math-17k: vllm-project/vime's examples/multi_agent run script, flag for
# flag, running its own Python files (rollout_with_multi_agents.py, agent_system.py,
# prompts.py) on vime. vllm-project/vime wrote it for Qwen3-30B-A3B, a mixture of experts vime does not
# train; the model here is a dense one (Qwen3-4B by default), with the parallelism flags sized for it.
# Paths come from the environment:
#   SEED_EXAMPLE_DIR  vllm-project/vime's examples/multi_agent directory (its Python files import
#                     themselves as `examples.multi_agent.*`, so its parent's parent goes on PYTHONPATH)
#   MODEL_DIR         an HF model directory (default /root/Qwen3-4B)
#   DATA_PATH         dapo-math-17k as JSONL: `prompt` (chat messages) and `label`
#   CKPT_DIR          checkpoints; a rerun resumes from the newest (default /root/Qwen3-4B_vime/)
#   MODEL_SHAPE       which scripts/models/<name>.sh describes MODEL_DIR (default qwen3-4B)
#   GPUS              GPUs, shared by trainer and engines (--colocate, as vllm-project/vime ran it; default 8)
#   ENGINE_GPUS       GPUs per engine (default 1: one engine per GPU; more needs --rollout-backend vllm)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen3-4B}.sh"

: "${SEED_EXAMPLE_DIR:?set SEED_EXAMPLE_DIR to the examples/multi_agent directory of vllm-project/vime}"
SEED_ROOT="$(cd -- "${SEED_EXAMPLE_DIR}/../.." &>/dev/null && pwd)"
export PYTHONPATH="${SEED_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
MODEL_DIR=${MODEL_DIR:-/root/Qwen3-4B}
DATA_PATH=${DATA_PATH:-/root/dapo-math-17k/dapo-math-17k.jsonl}
CKPT_DIR=${CKPT_DIR:-/root/Qwen3-4B_vime/}
GPUS=${GPUS:-8}
ENGINE_GPUS=${ENGINE_GPUS:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}_torch_dist"   # not read: --kl-loss-coef 0 needs no reference model
   --load "${CKPT_DIR}"                   # empty on the first run: it starts from --hf-checkpoint
   --save "${CKPT_DIR}"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --custom-generate-function-path examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-context-len 16384
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size 256
   --balance-data
)

# vllm-project/vime leaves eval off for multi-agent runs; these only set how it would sample
EVAL_ARGS=(
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 1
)

PERF_ARGS=(
   --tensor-model-parallel-size 4
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1        # vllm-project/vime's 8 splits Qwen3-30B-A3B's experts; a dense model has none
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 20480
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

# vllm-project/vime adds --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer
# for the 30B model; vime refuses them (FSDP2 shards the optimizer state over the GPUs instead).
OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

# vllm-project/vime's engines took all 8 GPUs each (--rollout-num-gpus-per-engine 8) for the 30B model
VLLM_ARGS=(
   --rollout-num-gpus-per-engine "${ENGINE_GPUS}"
   --vllm-gpu-memory-utilization 0.7
   --vllm-cudagraph-capture-sizes 1 2 4 8 $(seq 16 8 256)
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
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
   "$@"

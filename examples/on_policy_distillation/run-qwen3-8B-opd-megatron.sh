#!/bin/bash
# On-policy distillation with the teacher in the trainer: vllm-project/vime's
# examples/on_policy_distillation/run-qwen3-8B-opd-megatron.sh, flag for flag, on vime.
# The student samples, the teacher (loaded beside it) scores every trained token, and each
# token's advantage gains --opd-kl-coef x (log p_teacher - log p_student). As in vllm-project/vime, the
# teacher defaults to the student itself (self-distillation, a demonstration: its reverse KL
# starts at 0); point TEACHER_DIR at a stronger model of the same tokenizer.
# Paths come from the environment:
#   MODEL_DIR    the student, an HF model directory (default /root/Qwen3-8B)
#   TEACHER_DIR  the teacher: an HF directory or a vime --save directory (default MODEL_DIR)
#   DATA_PATH    dapo-math-17k as JSONL: `prompt` (chat messages) and `label`
#   CKPT_DIR     checkpoints; a rerun resumes from the newest (default /root/Qwen3-8B_vime/)
#   MODEL_SHAPE  which scripts/models/<name>.sh describes MODEL_DIR (default qwen3-8B)
#   GPUS         GPUs, shared by trainer and engines (--colocate, as vllm-project/vime ran it; default 4)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
# vllm-project/vime loads both models from Megatron checkpoints (*_torch_dist); vime reads HF directories.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen3-8B}.sh"

MODEL_DIR=${MODEL_DIR:-/root/Qwen3-8B}
TEACHER_DIR=${TEACHER_DIR:-${MODEL_DIR}}
DATA_PATH=${DATA_PATH:-/root/dapo-math-17k/dapo-math-17k.jsonl}
CKPT_DIR=${CKPT_DIR:-/root/Qwen3-8B_vime/}
GPUS=${GPUS:-4}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}_torch_dist"   # not read: --kl-loss-coef 0 needs no reference model
   --load "${CKPT_DIR}"                   # empty on the first run: it starts from --hf-checkpoint
   --save "${CKPT_DIR}"
   --save-interval 10
   --megatron-to-hf-mode bridge           # no effect: vime trains the HF model itself
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --apply-chat-template
   --rollout-shuffle
   --rm-type math
   --num-rollout 300
   --rollout-batch-size 16
   --n-samples-per-prompt 4
   --rollout-max-response-len 16384
   --rollout-temperature 1
   --global-batch-size 64
   --balance-data
)

RM_ARGS=(
   --rm-type math
)

PERF_ARGS=(
   --tensor-model-parallel-size 4
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 36
   --use-dynamic-batch-size
   --max-tokens-per-gpu 8192
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-opd
   --opd-type megatron
   --opd-kl-coef 1.0
   --opd-teacher-load "${TEACHER_DIR}"
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
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
   --vllm-gpu-memory-utilization 0.4
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
   --make-vocab-size-divisible-by 128
)

exec "${PYTHON:-python3}" "${VIME_ROOT}/train.py" \
   --train-backend megatron \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${GPUS}" \
   --rollout-num-gpus "${GPUS}" \
   --colocate \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${VLLM_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${RM_ARGS[@]}" \
   "$@"

#!/bin/bash
# On-policy distillation from a teacher served by an engine of its own: vllm-project/vime's
# examples/on_policy_distillation/run-qwen3-8B-opd.sh, flag for flag, on vime. It starts the
# teacher server, waits for its /health, trains, and stops the server it started.
# The teacher scores each response's tokens when the rollout is scored
# (vime.rollout.on_policy_distillation.reward_func at --rm-url); the post-process stores them
# on the samples and rewards 0, and the trainer adds --opd-kl-coef x (teacher - student) to
# each token's advantage. Paths and the server come from the environment:
#   MODEL_DIR       the student, an HF model directory (default /root/Qwen3-8B)
#   TEACHER_DIR     the teacher, an HF directory sharing the student's tokenizer (default /root/Qwen3-32B)
#   TEACHER_SERVER  vllm (vllm-project/vime's: vLLM's OpenAI server, asked at /v1/completions with
#                   --opd-type vllm) or vime (`vime serve`, asked at /generate with --opd-type sglang)
#   TEACHER_GPUS    the teacher's GPUs (default 4,5,6,7, tensor-parallel over all of them with vllm)
#   TEACHER_PORT    (default 13141)
#   DATA_PATH       dapo-math-17k as JSONL: `prompt` (chat messages)
#   CKPT_DIR        checkpoints; a rerun resumes from the newest (default /root/Qwen3-8B_vime/)
#   MODEL_SHAPE     which scripts/models/<name>.sh describes MODEL_DIR (default qwen3-8B)
#   GPUS            the student's GPUs, shared by trainer and engines (--colocate; default 4)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen3-8B}.sh"

MODEL_DIR=${MODEL_DIR:-/root/Qwen3-8B}
TEACHER_DIR=${TEACHER_DIR:-/root/Qwen3-32B}
TEACHER_SERVER=${TEACHER_SERVER:-vllm}
TEACHER_GPUS=${TEACHER_GPUS:-4,5,6,7}
TEACHER_IP=127.0.0.1
TEACHER_PORT=${TEACHER_PORT:-13141}
DATA_PATH=${DATA_PATH:-/root/dapo-math-17k/dapo-math-17k.jsonl}
CKPT_DIR=${CKPT_DIR:-/root/Qwen3-8B_vime/}
GPUS=${GPUS:-4}
PYTHON=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

TEACHER_LOG=$(mktemp -t opd_teacher_XXXXXX.log)
case "${TEACHER_SERVER}" in
   vllm)
      OPD_TYPE=vllm
      TEACHER_ROUTE=/v1/completions  # every vLLM server scores there (/inference/v1/generate needs --enable-scale-out)
      TP=$(awk -F, '{print NF}' <<<"${TEACHER_GPUS}")
      CUDA_VISIBLE_DEVICES="${TEACHER_GPUS}" "${PYTHON}" -m vllm.entrypoints.openai.api_server \
         --model "${TEACHER_DIR}" --host "${TEACHER_IP}" --port "${TEACHER_PORT}" \
         --tensor-parallel-size "${TP}" --gpu-memory-utilization 0.85 --trust-remote-code \
         --dtype bfloat16 --max-model-len 16384 --disable-custom-all-reduce >"${TEACHER_LOG}" 2>&1 &
      ;;
   vime)
      OPD_TYPE=sglang
      TEACHER_ROUTE=/generate
      DEVICE=cpu
      [ -n "${TEACHER_GPUS}" ] && [ "${TEACHER_GPUS}" != cpu ] && DEVICE=cuda
      CUDA_VISIBLE_DEVICES="${TEACHER_GPUS/cpu/}" "${PYTHON}" -m vime serve --model-path "${TEACHER_DIR}" \
         --host "${TEACHER_IP}" --port "${TEACHER_PORT}" --device "${DEVICE}" >"${TEACHER_LOG}" 2>&1 &
      ;;
   *)
      echo "TEACHER_SERVER=${TEACHER_SERVER}: use vllm or vime" >&2
      exit 2
      ;;
esac
TEACHER_PID=$!
trap 'kill "${TEACHER_PID}" 2>/dev/null || true' EXIT
echo "teacher server (${TEACHER_SERVER}, pid ${TEACHER_PID}, log ${TEACHER_LOG}) starting on port ${TEACHER_PORT}"
for i in $(seq 1 120); do
   if ! kill -0 "${TEACHER_PID}" 2>/dev/null; then
      echo "the teacher server exited before it was up; its log ${TEACHER_LOG} ends:" >&2
      tail -n 20 "${TEACHER_LOG}" >&2
      exit 1
   fi
   if curl -sf -o /dev/null "http://${TEACHER_IP}:${TEACHER_PORT}/health"; then
      break
   fi
   if [ "$i" -eq 120 ]; then
      echo "the teacher server did not answer /health within 10 minutes; see ${TEACHER_LOG}" >&2
      exit 1
   fi
   sleep 5
done

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}_torch_dist"   # not read: --kl-loss-coef 0 needs no reference model
   --load "${CKPT_DIR}"                   # empty on the first run: it starts from --hf-checkpoint
   --save "${CKPT_DIR}"
   --save-interval 20
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
   --rollout-max-response-len 4096
   --rollout-max-context-len 8192
   --rollout-temperature 1
   --global-batch-size 64
   --balance-data
)

RM_ARGS=(
   --custom-rm-path vime.rollout.on_policy_distillation.reward_func
   --custom-reward-post-process-path vime.rollout.on_policy_distillation.post_process_rewards
   --rm-url "http://${TEACHER_IP}:${TEACHER_PORT}${TEACHER_ROUTE}"
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
   --max-tokens-per-gpu 2048
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-opd
   --opd-type "${OPD_TYPE}"
   --opd-kl-coef 1.0
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
   --vllm-gpu-memory-utilization 0.25
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
   --make-vocab-size-divisible-by 128
)

# not exec: the trap stops the teacher when training ends
"${PYTHON}" "${VIME_ROOT}/train.py" \
   --train-backend megatron \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${GPUS}" \
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

#!/bin/bash
# Search-R1 lite on Qwen2.5-3B: vllm-project/vime's examples/search-r1/run_qwen2.5_3B.sh, flag for
# flag, running vllm-project/vime's own Python files (generate_with_search.py, qa_em_format.py,
# local_search_server.py) on vime. Their `slime.*` imports load vime's modules. The retriever
# they ask is at http://127.0.0.1:8000/retrieve (set in generate_with_search.py's
# SEARCH_R1_CONFIGS): vllm-project/vime's dense retriever, or retrieval_standin.py here. Paths from the
# environment:
#   SEED_EXAMPLE_DIR  vllm-project/vime's examples/search-r1 folder (its Python files are imported from it)
#   MODEL_DIR         an HF model directory (default /root/Qwen2.5-3B/)
#   DATA_PATH         Search-R1's nq_hotpotqa_train/train.parquet (`prompt`, `reward_model`)
#   REF_LOAD          the KL reference model, an HF directory (default MODEL_DIR)
#   MODEL_SHAPE       which scripts/models/<name>.sh describes MODEL_DIR (default qwen2.5-3B)
#   ACTOR_GPUS / ROLLOUT_GPUS  trainer and engine GPUs, colocated (default 4 and 4)
#   ENTRY             train.py (vllm-project/vime's, default) or train_async.py (see README.md)
# Extra arguments are appended, so they override the flags below (argparse keeps the last).
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"
: "${SEED_EXAMPLE_DIR:?set SEED_EXAMPLE_DIR to vllm-project/vime\'s examples/search-r1 folder}"
source "${VIME_ROOT}/scripts/models/${MODEL_SHAPE:-qwen2.5-3B}.sh"

MODEL_DIR=${MODEL_DIR:-/root/Qwen2.5-3B/}
DATA_PATH=${DATA_PATH:-/root/Search-R1/data/nq_hotpotqa_train/train.parquet}
ACTOR_GPUS=${ACTOR_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}
export PYTHONPATH="${SEED_EXAMPLE_DIR}:${VIME_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   # vllm-project/vime's was the Megatron copy (${MODEL_DIR}_torch_dist): vime reads an HF directory, by default the model itself
   --ref-load "${REF_LOAD:-${MODEL_DIR}}"
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --label-key reward_model               # a dict ({"ground_truth": {"target": [...]}}): passed as one
   --apply-chat-template
   --rollout-shuffle
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 512
   --rollout-temperature 1
   --global-batch-size 256
   --balance-data
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
   --kl-loss-coef 0.001
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.01
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
   --custom-generate-function-path generate_with_search.generate
   --custom-rm-path generate_with_search.reward_func
)

ENTRY=${ENTRY:-train.py}
COLOCATE=(--colocate)
[ "${ENTRY}" = train.py ] || COLOCATE=()

exec "${PYTHON:-python3}" "${VIME_ROOT}/${ENTRY}" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${ACTOR_GPUS}" \
   --rollout-num-gpus "${ROLLOUT_GPUS}" \
   "${COLOCATE[@]}" \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${VLLM_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${CUSTOM_ARGS[@]}" \
   "$@"

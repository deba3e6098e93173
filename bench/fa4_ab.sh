#!/usr/bin/env bash
# FlashAttention-4 against FlashAttention-2 in the trainer, on one GPU, in one call (issue 50):
# the two FA4 GPU tests, the kernels alone (bench_attention.py), then the 0.6B trainer step with
# each kernel, FA2 first and last so that a drifting machine shows (profile_trainer.py). With
# `4b` as its argument, the 4B shape's step instead (realistic protocol: /scoredold).
# Needs flash-attn-4 installed (bench/fa4_prep.sh, which says how it travels to a lent machine):
#     bash bench/fa4_prep.sh && bash bench/fa4_ab.sh [4b]
# Kernels the CuTe DSL compiles are kept on disk for the next process of the same machine.
set -uo pipefail
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
python3 -c "import flash_attn.cute.interface" || { echo "[fa4_ab] flash-attn-4 does not import"; exit 1; }
if [ "${1:-}" = 4b ]; then
    python3 bench/profile_trainer.py --shape qwen3-4b --no-trace --steps 3 \
        --variants compile@4096:8192/scoredold/fa2,compile@4096:8192/scoredold/fa4,compile@4096:8192/scoredold/fa2
    exit
fi
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_trainer.py -k fa4 2>&1 | tail -15
timeout 120 python3 bench/bench_attention.py --variants flash,fa4
python3 bench/profile_trainer.py --no-trace --steps 3 \
    --variants compile@4096:16384/fa2,compile@4096:16384/fa4,compile@4096:16384/fa2

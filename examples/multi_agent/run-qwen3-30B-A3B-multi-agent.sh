#!/bin/bash
# vllm-project/vime's run-qwen3-30B-A3B-multi-agent.sh on the mixture of experts it was written
# for (Qwen3-30B-A3B): run-qwen3-4B-multi-agent.sh's flags (its, flag for flag) with that model, its
# shape (scripts/models/qwen3-30B-A3B.sh: slime's MoE flags, checked against its config.json) and
# its experts split over the actor GPUs, as its --expert-model-parallel-size 8 split them over its 8
# (vime splits them over every actor GPU: the flag follows GPUS). The built-in engine holds the
# whole model on each GPU (60 GB of bf16 weights: an H200; vllm-project/vime ran vLLM engines of 8
# GPUs: --rollout-backend vllm --rollout-num-gpus-per-engine 8). Environment as the 4B script's.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
export MODEL_DIR="${MODEL_DIR:-/root/Qwen3-30B-A3B}"
export MODEL_SHAPE="${MODEL_SHAPE:-qwen3-30B-A3B}"
export CKPT_DIR="${CKPT_DIR:-/root/Qwen3-30B-A3B_vime/}"
exec bash "${SCRIPT_DIR}/run-qwen3-4B-multi-agent.sh" --expert-model-parallel-size "${GPUS:-8}" "$@"

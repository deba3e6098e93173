# The random tiny Qwen3-MoE of the CPU tests (tests/unit/trainer/moe_models.py): the tiny Qwen3's shape with 4
# experts of its MLP's quarter size in each of its 2 layers, 2 routed per token, in Megatron's flags.
source "$(dirname -- "${BASH_SOURCE[0]}")/tiny-qwen3.sh"
MODEL_ARGS+=(
   --num-experts 4
   --moe-ffn-hidden-size 32
   --moe-router-topk 2
   --moe-layer-freq 1
   --moe-router-score-function softmax
   --moe-grouped-gemm
   --moe-aux-loss-coeff 0
)

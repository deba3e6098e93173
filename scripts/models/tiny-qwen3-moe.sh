# The random tiny Qwen3-MoE of the CPU tests (tests/moe_models.py: 2 layers, 4 experts of which 2
# route each token, character tokenizer), in Megatron's flags: what they run the seed's MoE example
# scripts with.
MODEL_ARGS=(
   --num-layers 2
   --hidden-size 64
   --ffn-hidden-size 128
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 16
   --vocab-size 100
   --swiglu
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --use-rotary-position-embeddings
   --rotary-base 10000
   --qk-layernorm
   --disable-bias-linear
   --untie-embeddings-and-output-weights

   --num-experts 4
   --moe-ffn-hidden-size 32
   --moe-router-topk 2
   --moe-layer-freq 1
   --moe-router-score-function softmax
   --moe-grouped-gemm
   --moe-aux-loss-coeff 0
)

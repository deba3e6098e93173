# Qwen3-8B in Megatron's flags, for run scripts written for slime (the seed's on-policy
# distillation example). vime reads the shape from the checkpoint and checks these flags against
# its config.json before it starts. Unlike Qwen3-4B it does not tie its embeddings.
MODEL_ARGS=(
   --num-layers 36
   --hidden-size 4096
   --ffn-hidden-size 12288
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --vocab-size 151936
   --swiglu
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --use-rotary-position-embeddings
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-1000000}"
   --disable-bias-linear
   --qk-layernorm
   --untie-embeddings-and-output-weights
)

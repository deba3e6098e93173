# Qwen2.5-0.5B-Instruct in Megatron's flags, for run scripts written for slime. vime reads the
# shape from the checkpoint and checks these flags against its config.json before it starts.
MODEL_ARGS=(
   --num-layers 24
   --hidden-size 896
   --ffn-hidden-size 4864
   --num-attention-heads 14
   --group-query-attention
   --num-query-groups 2
   --vocab-size 151936
   --swiglu
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --add-qkv-bias
)

# Qwen2.5-3B in Megatron's flags (the seed's search-r1 example trains it). vime reads the shape
# from the checkpoint and checks these flags against its config.json before it starts. It ties
# its embeddings, as 0.5B does.
MODEL_ARGS=(
   --num-layers 36
   --hidden-size 2048
   --ffn-hidden-size 11008
   --num-attention-heads 16
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

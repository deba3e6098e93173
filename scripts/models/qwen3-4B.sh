# Qwen3-4B in Megatron's flags, for run scripts written for slime. vime reads the shape from the
# checkpoint and checks these flags against its config.json before it starts. (Qwen3-4B's own
# config has rope_theta 1000000; the 2507 releases use 5000000: pass what your checkpoint has.)
MODEL_ARGS=(
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
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
)

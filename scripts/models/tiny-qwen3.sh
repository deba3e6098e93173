# The random tiny Qwen3 that `vime.models.make_tiny_model` writes with its defaults (2 layers,
# character tokenizer), in Megatron's flags: what the CPU tests run the seed's example scripts with.
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
)

# SmolLM2-135M-Instruct (vime's embedded default, `--hf-checkpoint smollm2`) in Megatron's flags:
# what the CPU tests run the seed's scripts with. It ties its embeddings (no
# --untie-embeddings-and-output-weights) and has no biases.
MODEL_ARGS=(
   --num-layers 30
   --hidden-size 576
   --ffn-hidden-size 1536
   --num-attention-heads 9
   --group-query-attention
   --num-query-groups 3
   --kv-channels 64
   --vocab-size 49152
   --swiglu
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --use-rotary-position-embeddings
   --rotary-base 100000
   --disable-bias-linear
)

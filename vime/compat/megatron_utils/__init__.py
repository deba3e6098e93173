"""`vime.backends.megatron_utils`: vllm-project/vime's Megatron helpers that its plug-ins import
(train_infer_mismatch_helper's mis.py: `cp_utils`). vime trains with FSDP2 and never splits a
sequence over GPUs, so these are what Megatron's are with a context-parallel group of one."""

"""The stand-in's agents package: only what vllm-project/vime's agent imports from it."""

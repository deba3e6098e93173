"""The stand-in's agents package: only what vllm-project/vime's and slime's tau-bench agents import from it."""

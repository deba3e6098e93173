"""Weight pushes from the trainer to the engines, every transport: what each one does
(`base.Transport`; one file per transport: `shm.py`, `disk.py`, `cuda_ipc.py`, `broadcast.py`),
the process group of the broadcast ones (`group.py`), their flat buckets (`buckets.py`), the
checksums both sides compare (`checksums.py`) and the trainer's pusher (`push.py`).

The table is plain data, as vime.backends' is: rows name their class by import path, imported
when a push uses it, so `vime.config` reads the flag's values without importing torch."""

# --weight-transport value → "module:Class", a subclass of `vime.transport.base.Transport`. A new
# transport is one file and one row here
TRANSPORT_CLASSES = {
    "shm": "vime.transport.shm:SharedMemory",
    "disk": "vime.transport.disk:Disk",
    "cuda_ipc": "vime.transport.cuda_ipc:CudaIpc",
    "nccl": "vime.transport.broadcast:Broadcast",
    "gloo": "vime.transport.broadcast:Broadcast",
}

# every --weight-transport value; `auto` lets the placement pick per engine
TRANSPORTS = ("auto", *TRANSPORT_CLASSES)

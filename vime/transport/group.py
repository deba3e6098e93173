"""The process group that carries weight pushes from the trainer to engines, both sides of it.

SGLang's protocol, which slime users know: the trainer's rank 0 opens a TCP rendezvous and asks
every engine to join (`POST /init_weights_update_group {master_address, master_port,
rank_offset, world_size, group_name, backend}`); the trainer is rank 0 of that group, engine i
holds ranks rank_offset .. rank_offset + tp - 1. Each push is then a series of broadcasts from
rank 0, each announced to the engines by `POST /update_weights_from_distributed {names, dtypes,
shapes, group_name, weight_version, flush_cache, load_format}` so they post matching receives
(the buckets: `buckets.py`; their checksums: `checksums.py`).

The group is *stateless*: a TCPStore and a backend object made directly, never
`init_process_group`, so it exists beside the trainer's own FSDP group (engines are no trainer
ranks) and an engine can join groups of several trainers over its life. NCCL carries it between
GPUs, gloo on CPU (which is how `make test` runs the very same code).

Nothing here may hang: the rendezvous, the first collective and every broadcast are bounded by
the group's timeout, and a failed or late collective aborts the group, after which every
further use raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import Tensor

from vime.errors import VimeError

log = logging.getLogger(__name__)

# NVLink multicast (NVLS) can take a shared host's GPUs out of service: off in every process that
# vime starts and in its own (device README). Set before any NCCL communicator exists.
GPU_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def apply_gpu_safe_env(env: dict[str, str] | os._Environ = os.environ) -> dict[str, str] | os._Environ:
    """Set the multicast-off variables where the caller left them unset; returns `env`."""
    for key, value in GPU_SAFE_ENV.items():
        env.setdefault(key, value)
    return env


class WeightSyncError(VimeError, RuntimeError):
    """The weight group failed (a peer died, never joined, or a collective timed out)."""


class WeightGroup:
    """One member's handle on the weight-push group.

    `broadcast` returns the backend's work object; `wait` polls it together with any other
    condition the caller must watch (an engine's HTTP answer), so that a dead peer ends the wait
    at once instead of at the timeout. A group whose collective failed is aborted and unusable.
    """

    def __init__(
        self, backend: str, pg, rank: int, world_size: int, device: torch.device, timeout: float, store
    ) -> None:
        self.backend, self.pg, self.rank, self.world_size = backend, pg, rank, world_size
        self.device, self.timeout = device, timeout
        self._store = store  # the store must outlive the group (the backend reads it lazily)
        self.broken: str | None = None

    def broadcast(self, tensor: Tensor) -> object:
        if self.broken is not None:
            raise WeightSyncError(
                f"the weight group is unusable after an earlier failure ({self.broken}): restart the run"
            )
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def wait(self, work, what: str, check: Callable[[], None] | None = None, deadline: float | None = None) -> None:
        """Wait for `work`, calling `check()` (which raises to give up) while it runs; abort the
        group and raise WeightSyncError on a failure or once `deadline` (default: now + timeout)
        passes. For NCCL completion means the transfer is done on the device."""
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        try:
            while not work.is_completed():
                # torn down from another thread (an engine told to leave or replace the group, its
                # sender gone mid-push): gloo's abort does not end a receive that waits on the peer
                if self.broken is not None:
                    raise WeightSyncError(f"{what}: the weight group was torn down ({self.broken})")
                if check is not None:
                    check()
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{what}: timed out after {self.timeout:g}s")
                time.sleep(0.0002)
            try:
                work.wait()  # surfaces the backend's error; on NCCL also orders the current stream after it
            except RuntimeError as e:  # gloo: "Connection closed by peer ...", NCCL: a watchdog report
                raise WeightSyncError(f"{what}: {' '.join(str(e).split())[:300]}") from None
        except BaseException as e:
            self.abort(f"{what}: {e}")
            raise

    def abort(self, reason: str) -> None:
        """Tear the group down so no process stays blocked in it (NCCL kernels waiting for a dead
        peer would otherwise hold the device until the watchdog fires)."""
        if self.broken is None:
            log.error("weight group aborted: %s", reason)
            self._tear_down(reason)

    def close(self) -> None:
        """Leave the group. Each member tears down its own side, whenever it likes: an abort, not
        NCCL's graceful shutdown, which waits for every member to shut down too (a trainer that
        waited for an engine's answer before its own shutdown would wait for ever)."""
        if self.broken is None:
            self._tear_down("closed")

    def _tear_down(self, reason: str) -> None:
        self.broken = reason
        # abort() returns at once with no collective in flight; bounded anyway, since a driver
        # that blocks here would take the caller (an engine's step thread) with it
        t = threading.Thread(target=self._abort_backend, name="vime-weights-abort", daemon=True)
        t.start()
        t.join(10.0)
        if t.is_alive():
            log.warning("tearing down the weight group did not finish within 10 s; left to finish in the background")

    def _abort_backend(self) -> None:
        try:
            self.pg.abort()
        except Exception as e:  # the group is unusable either way
            log.debug("abort of the weight group failed: %r", e)


def open_store(master_address: str, master_port: int, world_size: int, timeout: float):
    """The trainer's side of the rendezvous: a TCPStore server engines connect to. Port 0 picks a
    free port (read it back from `.port`)."""
    from torch.distributed import TCPStore

    return TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def join(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    device: torch.device,
    timeout: float,
    store=None,
    check: Callable[[], None] | None = None,
) -> WeightGroup:
    """Join the group as `rank`; returns once every member has joined and a first broadcast went
    through (so NCCL's communicator set-up is paid here, not in the first push).

    The wait for the other members is bounded and watched: `check()` is called while waiting and
    may raise (the trainer passes one that fails when an engine's join call failed).
    """
    from torch.distributed import PrefixStore, TCPStore

    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight group backend '{backend}': use nccl or gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the nccl weight group needs a CUDA device, this process is on {device}: use backend gloo")
    deadline = time.monotonic() + timeout
    if store is None:
        store = TCPStore(master_address, master_port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
    store = PrefixStore(f"vime-weights/{group_name}", store)
    # A barrier on the store before the backend exists: a member that never comes shows as a
    # timeout here (and `check` can fail sooner), not as a collective blocked in a driver.
    store.add("joined", 1)
    while store.add("joined", 0) < world_size:
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"weight group '{group_name}': {store.add('joined', 0)} of {world_size} members joined within {timeout:g}s"
            )
        time.sleep(0.005)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        apply_gpu_safe_env()
        torch.cuda.set_device(device)
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        pg = ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        from torch.distributed import ProcessGroupGloo

        pg = ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout))
    group = WeightGroup(backend, pg, rank, world_size, device, timeout, store)
    probe = torch.ones(1, device=device if backend == "nccl" else "cpu")
    group.wait(group.broadcast(probe), f"weight group '{group_name}': first broadcast", check, deadline)
    return group

"""The process group that carries weight pushes from the trainer to engines, both sides of it.

SGLang's protocol, which slime users know: the trainer's rank 0 opens a TCP rendezvous and asks
every engine to join (`POST /init_weights_update_group {master_address, master_port,
rank_offset, world_size, group_name, backend}`); the trainer is rank 0 of that group, engine i
holds ranks rank_offset .. rank_offset + tp - 1. Each push is then a series of broadcasts from
rank 0, each announced to the engines by `POST /update_weights_from_distributed {names, dtypes,
shapes, group_name, weight_version, flush_cache, load_format}` so they post matching receives.
`load_format: "flattened_bucket"` (vime's trainer always sends it) means one broadcast of one
flat buffer holding the named tensors back to back, all of one dtype; without it each tensor
is its own broadcast, as SGLang does.

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
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch
from torch import Tensor

from vime.errors import VimeError

log = logging.getLogger(__name__)

FLATTENED = "flattened_bucket"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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


# ---- the engine's side ---------------------------------------------------------------------


def parse_layout(names: list, dtypes: list, shapes: list) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Validate an announced bucket; ValueError (→ HTTP 400) on anything malformed."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(
            f"names, dtypes and shapes must be non-empty lists of one length (got {len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    out = []
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str):
            raise ValueError(f"weight name {n!r} is not a string")
        if d not in DTYPES:
            raise ValueError(f"weight '{n}': dtype {d!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise ValueError(f"weight '{n}': shape {s!r} is not a list of sizes")
        out.append((n, DTYPES[d], tuple(s)))
    return out


def receive(
    group: WeightGroup, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], flattened: bool
) -> Iterator[tuple[str, Tensor]]:
    """Post the receives for one announced bucket; yields (name, tensor) on the group's device
    (gloo: CPU) as they arrive, for the engine to copy into its parameters."""
    device = group.device if group.backend == "nccl" else torch.device("cpu")
    if flattened:
        dtypes = {d for _, d, _ in layout}
        if len(dtypes) != 1:
            raise ValueError("a flattened bucket holds one dtype")
        sizes = [math.prod(s) for _, _, s in layout]
        flat = torch.empty(sum(sizes), dtype=dtypes.pop(), device=device)
        group.wait(group.broadcast(flat), "weight bucket")
        for (name, _, shape), piece in zip(layout, flat.split(sizes)):
            yield name, piece.view(shape)
        return
    for name, dtype, shape in layout:
        t = torch.empty(shape, dtype=dtype, device=device)
        group.wait(group.broadcast(t), f"weight '{name}'")
        yield name, t


# ---- the trainer's side --------------------------------------------------------------------


def pack(
    tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[list[tuple[str, Tensor]], Tensor]]:
    """Cut a stream of named tensors into flat buckets of at most `bucket_bytes` (a larger tensor
    goes alone), cast to the engines' `dtype` on the way: half the bytes of a float32 master
    copy on the wire for a bfloat16 engine. Yields (the bucket's (name, tensor) list, flat buffer).

    The stream is consumed lazily, one bucket ahead at most, so a sharded trainer never holds
    more than a bucket of gathered tensors."""
    item = dtype.itemsize
    capacity = max(1, bucket_bytes // item)
    names: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in tensors:
        n = t.numel()
        if names and size + n > capacity:
            yield names, _flatten(names, size, dtype, device)
            names, size = [], 0
        names.append((name, t))
        size += n
    if names:
        yield names, _flatten(names, size, dtype, device)


def _flatten(items: list[tuple[str, Tensor]], size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One flat buffer in a few launches (a batched cat, then one cast when the trainer's dtype
    differs), not one copy per tensor: at 0.6B the launches cost more than the bytes."""
    parts = [t.detach().to(device).reshape(-1) for _, t in items]  # .to: a no-op on the same device
    if all(p.dtype == dtype for p in parts):
        return torch.cat(parts, out=torch.empty(size, dtype=dtype, device=device))
    return torch.cat(parts).to(dtype)


# ---- proof of arrival -------------------------------------------------------------------------


def non_finite(named: list[tuple[str, Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or inf, else None: one fused float32 norm
    over them all and one sync (a NaN or inf anywhere makes its tensor's norm non-finite)."""
    floats = [(n, t) for n, t in named if t.is_floating_point()]
    if not floats:
        return None
    norms = torch.stack(torch._foreach_norm([t for _, t in floats], dtype=torch.float32))
    bad = (~torch.isfinite(norms)).nonzero()
    return floats[int(bad[0])][0] if bad.numel() else None


def checksums(tensors: Iterable[Tensor]) -> list[list[int]]:
    """[bit sum, element count] of each tensor (`bit_sum`).

    Both sides of a push compute them, the trainer on what it sends (in the engines' dtype) and
    the engine on what it holds or received, so a tensor that did not arrive, arrived to the
    wrong place or was not loaded shows as a mismatch, exactly: no tolerance, no float rounding.
    Read back in one transfer (on a GPU, one sync per bucket rather than one per tensor).
    """
    sums, sizes = [], []
    for t in tensors:
        sums.append(bit_sum(t).to(torch.int64))
        sizes.append(t.numel())
    return [[s, n] for s, n in zip(torch.stack(sums).tolist(), sizes)] if sums else []


def bit_sum(t: Tensor) -> Tensor:
    """The tensor's bytes read as little-endian 32-bit words (64-bit for 8-byte dtypes) and
    summed, wrapping: the same in any order and on any device, and as fast as a plain sum (a
    widening integer sum is 20x slower on CPU). A 2-byte tensor's words pair its elements; one
    not aligned to 4 bytes (a piece of a flat bucket) is paired explicitly, to the same value."""
    flat = t.detach().contiguous().reshape(-1)
    width = flat.element_size()
    if width == 4:
        return flat.view(torch.int32).sum(dtype=torch.int32)
    if width == 8:
        return flat.view(torch.int64).sum()
    if width == 1:
        return flat.view(torch.uint8).sum(dtype=torch.int32)
    v = flat.view(torch.int16)
    n = v.numel() - v.numel() % 2
    if v[:n].storage_offset() % 2 == 0:
        total = v[:n].view(torch.int32).sum(dtype=torch.int32)
    else:
        lo, hi = v[0:n:2].to(torch.int32) & 0xFFFF, v[1:n:2].to(torch.int32) << 16
        total = (lo + hi).sum(dtype=torch.int32)
    if n < v.numel():  # the odd element out, as a word whose upper half is zero
        total = total + (v[n:].to(torch.int32) & 0xFFFF).sum(dtype=torch.int32)
    return total


def checksum_mismatches(expected: dict[str, list[int]], got: dict[str, list[int]]) -> list[str]:
    """Names whose checksums differ (or that `got` lacks), for an error."""
    bad = []
    for name, want in expected.items():
        have = got.get(name)
        if have is None:
            bad.append(f"{name} (not held by the engine)")
        elif list(have) != list(want):
            bad.append(f"{name} (bit sums: trainer {want[0]}, engine {have[0]})")
    return bad

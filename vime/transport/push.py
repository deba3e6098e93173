"""Weight push transports: trainer → engines, HF-named tensors.

* shm: one safetensors file in /dev/shm, written once whatever the number of engines; each
  engine mmaps it and copies into its parameters; deleted when every engine has answered.
* disk: a safetensors directory as save_pretrained writes it (anything that can reload from
  disk, including engines on other machines when `tmp_dir` is on a shared filesystem).
* cuda_ipc: CUDA IPC handles of the trainer's own tensors, for engines on the same GPU; no
  copy on the trainer side at all.
* nccl (GPUs) / gloo (CPU, and what `make test` runs): engines join a process group with the
  trainer's rank 0 once (`connect`); each push then streams the weights, cast to the engines'
  dtype, in flat buckets of `bucket_bytes`, each announced over HTTP and broadcast
  (`vime/transport/group.py` has the protocol). Bounded: an engine that dies or hangs
  mid-push fails the push with its URL within `timeout` seconds.

Each engine has its own transport (a colocated run mixes cuda_ipc for the engine on the
trainer's GPU with nccl for the others). Pausing generation around a push is the train loop's
job; this module only moves tensors.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vime.errors import EngineError, VimeError
from vime.transport import TRANSPORTS, cuda_ipc
from vime.transport.buckets import DTYPES, FLATTENED, pack
from vime.transport.checksums import checksum_mismatches, checksums
from vime.transport.group import WeightGroup, WeightSyncError, join, open_store

log = logging.getLogger("vime")

DISTRIBUTED = ("nccl", "gloo")
DEFAULT_BUCKET_BYTES = 512 * 2**20  # large enough to hide per-bucket latency, small enough to stay cheap to stage
GROUP_NAME = "vime-weights"


class WeightPusher:
    """Pushes named weights to every engine client and stamps them with a weight version."""

    def __init__(
        self,
        clients: list[Any],
        transport: str | list[str] = "auto",
        tmp_dir: str | Path | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 120.0,
        master_address: str = "127.0.0.1",
        check: bool = True,
    ) -> None:
        transports = [transport] * len(clients) if isinstance(transport, str) else list(transport)
        if len(transports) != len(clients):
            raise ValueError(f"{len(transports)} weight transports for {len(clients)} engines")
        for t in transports:
            if t not in TRANSPORTS:
                raise ValueError(f"unknown weight transport {t!r}: one of {TRANSPORTS}")
        self.clients = list(clients)
        self.transports = transports
        self.tmp_dir = Path(tmp_dir) if tmp_dir is not None else None
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.master_address = master_address
        self.check = check  # compare checksums after every push (`verify`)
        self._group: WeightGroup | None = None
        self._engine_dtype: torch.dtype | None = None
        self._dtypes: dict[str, torch.dtype] = {}  # engine URL → the dtype it holds weights in
        # the last push's checksums as the engines should hold them: by dtype (what a broadcast
        # sent is in the group's dtype; other transports send the trainer's, cast by the engine)
        self._sent: dict[torch.dtype, dict[str, list[int]]] = {}
        self._lora_base = False  # the push under way carries a LoRA base (`push`)

    def push(
        self, named_weights: Iterable[tuple[str, Tensor]], version: int, lora_base: bool = False
    ) -> dict[str, float]:
        """Send the weights to all engines; returns perf/update_weights_* metrics.

        When every engine receives by broadcast the weights are streamed bucket by bucket (a
        sharded trainer gathers one bucket at a time); otherwise they are held together once.
        `lora_base`: these are a LoRA run's frozen base, which the engine keeps to merge the
        adapters of later pushes into (vLLM's receiver copies it only when told so)."""
        t0 = time.perf_counter()
        self._sent = {}
        self._lora_base = lora_base
        if all(t in DISTRIBUTED for t in self.transports):
            metrics = self._push_distributed(named_weights, version)
        else:
            weights = {name: t.detach().contiguous() for name, t in named_weights}
            metrics = {}
            for transport in dict.fromkeys(self._resolve(t, weights) for t in self.transports):
                clients = [c for c, t in zip(self.clients, self.transports) if self._resolve(t, weights) == transport]
                if transport == "shm":
                    metrics.update(self._push_shm(weights, version, clients))
                elif transport == "disk":
                    metrics.update(self._push_disk(weights, version, clients))
                elif transport == "cuda_ipc":
                    self._push_cuda_ipc(weights, version, clients)
                else:
                    metrics.update(self._push_distributed(weights.items(), version))
            metrics["perf/update_weights_bytes"] = float(sum(t.numel() * t.element_size() for t in weights.values()))
            if self.check:
                self._sent_from(weights)
        metrics["perf/update_weights_push_time"] = time.perf_counter() - t0
        if self.check:
            t1 = time.perf_counter()
            self.verify(version)
            metrics["perf/update_weights_check_time"] = time.perf_counter() - t1
        return metrics

    def _sent_from(self, weights: dict[str, Tensor]) -> None:
        """Checksums of a push that did not go by broadcast, cast as each engine holds them."""
        for dtype in {self._dtype_of(c) for c in self.clients} - set(self._sent):
            self._sent[dtype] = dict(zip(weights, checksums(t.to(dtype) for t in weights.values())))

    def _dtype_of(self, client: Any) -> torch.dtype:
        if client.url not in self._dtypes:
            self._dtypes[client.url] = _common_dtype([client.model_info()], [client.url])
        return self._dtypes[client.url]

    def verify(self, version: int) -> None:
        """Every engine holds what the trainer sent: the checksum of each pushed tensor, computed
        by the engine on what it holds (the built-in engine reads its parameters back; vLLM's
        worker extension sums what it received and refuses a push that left a layer out),
        equals the trainer's. A mismatch stops the run with the engine and the tensors."""

        def check(c: Any) -> None:
            want = self._sent[self._dtype_of(c)]
            bad = checksum_mismatches(want, c.weight_checksums())
            if bad:
                raise EngineError(
                    f"weight push v{version}: engine at {c.url} does not hold what the trainer sent, {len(bad)} of {len(want)} "
                    f"tensors differ: {', '.join(bad[:3])}"
                )

        self._each_client(check)

    def set_engines(self, clients: list[Any], transports: list[str]) -> None:
        """The engines the next push goes to (some died, or came back from a restart). A weight
        group formed with other members is left, and formed again at the next push."""
        if [c.url for c in clients] == [c.url for c in self.clients] and list(transports) == self.transports:
            self.clients = list(clients)
            return
        self.close()
        self.clients, self.transports = list(clients), list(transports)
        self._dtypes = {u: d for u, d in self._dtypes.items() if u in {c.url for c in clients}}

    @staticmethod
    def _resolve(transport: str, weights: dict[str, Tensor]) -> str:
        """auto: shm for CPU weights, disk for GPU ones (correct whichever GPU the engines use;
        the placement picks cuda_ipc or nccl explicitly when it knows where the engines are)."""
        if transport != "auto":
            return transport
        return "shm" if all(t.device.type == "cpu" for t in weights.values()) else "disk"

    def _each_client(self, call: Callable[[Any], Any], clients: list[Any] | None = None) -> None:
        """Run `call` on every client concurrently: engines load in parallel, not in turn."""
        clients = self.clients if clients is None else clients
        if len(clients) <= 1:
            for c in clients:
                call(c)
            return
        with ThreadPoolExecutor(len(clients)) as pool:
            for future in [pool.submit(call, c) for c in clients]:
                future.result()

    def _push_shm(self, weights: dict[str, Tensor], version: int, clients: list[Any]) -> dict[str, float]:
        base = self.tmp_dir or (Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir()))
        path = base / f"vime-weights-{os.getpid()}-v{version}.safetensors"
        t0 = time.perf_counter()
        try:
            _write(weights, path)
            write_time = time.perf_counter() - t0
            payload = {"transport": "shm", "path": str(path), "weight_version": version}
            self._each_client(lambda c: c.update_weights_from_tensor(payload, self.timeout), clients)
        finally:
            path.unlink(missing_ok=True)
        return {"perf/update_weights_write_time": write_time}

    def _push_disk(self, weights: dict[str, Tensor], version: int, clients: list[Any]) -> dict[str, float]:
        if self.tmp_dir is not None:
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"vime-weights-v{version}-", dir=self.tmp_dir))
        # in the engines' dtype when they share one: half the bytes of float32 master weights for
        # bfloat16 engines, and the tensors the engines checksum are then the ones the trainer did
        dtypes = {self._dtype_of(c) for c in clients}
        cast = dtypes.pop() if len(dtypes) == 1 else None
        t0 = time.perf_counter()
        try:
            _write(
                {k: (t if cast is None else t.to(cast)).cpu() for k, t in weights.items()}, out / "model.safetensors"
            )
            write_time = time.perf_counter() - t0
            base = {"lora_base": True} if self._lora_base else {}  # said only when so: any client takes the rest
            self._each_client(lambda c: c.update_weights_from_disk(str(out), version, self.timeout, **base), clients)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return {"perf/update_weights_write_time": write_time}

    def _push_cuda_ipc(self, weights: dict[str, Tensor], version: int, clients: list[Any]) -> None:
        # `weights` keeps the tensors alive until every engine has copied from them. The handles
        # travel as plain JSON data (vime/transport/cuda_ipc.py), never as a pickle.
        payload = {"transport": "cuda_ipc", "handles": cuda_ipc.share(list(weights.items())), "weight_version": version}
        self._each_client(lambda c: c.update_weights_from_tensor(payload, self.timeout), clients)

    # ---- nccl / gloo ---------------------------------------------------------------------

    def connect(self, device: str | torch.device) -> None:
        """Form the weight group with every engine that receives by broadcast, once per run (at
        start-up, so NCCL's set-up is not charged to the first step's push). No-op otherwise.

        The trainer's rank 0 is rank 0 of the group; engine i holds ranks `rank_offset` ..
        `rank_offset + tp − 1`. The engines' join calls run in threads while this side joins;
        any of them failing (an engine that died or refused) ends the wait at once."""
        dist_clients = self._clients_of(DISTRIBUTED)
        if not dist_clients or self._group is not None:
            return
        backend = self._backend()
        device = torch.device(device) if backend == "nccl" else torch.device("cpu")
        deadline = time.monotonic() + self.timeout
        pool = ThreadPoolExecutor(len(dist_clients), thread_name_prefix="vime-weights")
        try:
            asked = {c: pool.submit(c.model_info) for c in dist_clients}
            infos = [
                _result(c, f, "reading its model info", max(0.0, deadline - time.monotonic())) for c, f in asked.items()
            ]
            self._engine_dtype = _common_dtype(infos, [c.url for c in dist_clients])
            tp = [int(i.get("tp_size", 1)) for i in infos]
            world = 1 + sum(tp)
            store = open_store(self.master_address, 0, world, self.timeout)
            offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
            joins = {
                c: pool.submit(
                    c.init_weights_update_group,
                    {
                        "master_address": self.master_address,
                        "master_port": store.port,
                        "rank_offset": off,
                        "world_size": world,
                        "group_name": GROUP_NAME,
                        "backend": backend,
                        "timeout": self.timeout,
                    },
                )
                for c, off in zip(dist_clients, offsets)
            }
            check = _failed_calls(joins, "joining the weight group")
            self._group = join(
                backend,
                self.master_address,
                store.port,
                0,
                world,
                GROUP_NAME,
                device,
                self.timeout,
                store=store,
                check=check,
            )
            for c, f in joins.items():
                _result(c, f, "joining the weight group", max(0.0, deadline - time.monotonic()))
        except WeightSyncError as e:
            raise EngineError(f"weight group ({backend}) with {', '.join(c.url for c in dist_clients)}: {e}") from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _push_distributed(self, weights: Iterable[tuple[str, Tensor]], version: int) -> dict[str, float]:
        """Broadcast flat buckets (`load_format: flattened_bucket`) to every engine of the group.

        Per bucket: announce it to the engines (HTTP, in threads), broadcast it, then wait for the
        broadcast and for every engine's answer together. An engine that dies or refuses ends the
        wait at once and aborts the group; the whole push is bounded by the timeout."""
        stream = iter(weights)
        first = next(stream, None)
        if first is None:
            return {}
        if self._group is None:
            self.connect(first[1].device)
        group = self._group
        assert group is not None and self._engine_dtype is not None
        clients = self._clients_of(DISTRIBUTED)
        device = group.device
        deadline = time.monotonic() + self.timeout
        nbuckets = 0
        nbytes = 0
        pool = ThreadPoolExecutor(len(clients), thread_name_prefix="vime-weights")
        try:
            buckets = pack(_chain(first, stream), self.bucket_bytes, self._engine_dtype, device)
            current = next(buckets)
            while current is not None:
                items, flat = current
                following = next(buckets, None)  # staged now: the last bucket must say it is the last
                nbuckets += 1
                nbytes += flat.numel() * flat.element_size()
                if self.check:
                    pieces = flat.split([t.numel() for _, t in items])
                    sent = self._sent.setdefault(self._engine_dtype, {})
                    sent.update(zip([n for n, _ in items], checksums(pieces)))
                body = {
                    "names": [n for n, _ in items],
                    "dtypes": [str(self._engine_dtype).removeprefix("torch.")] * len(items),
                    "shapes": [list(t.shape) for _, t in items],
                    "group_name": GROUP_NAME,
                    "weight_version": version,
                    "flush_cache": following is None,  # cached prefixes hold KV of the old weights
                    "load_format": FLATTENED,
                    "lora_base": self._lora_base,
                }
                what = f"weight push v{version}, bucket {nbuckets}"
                calls = {c: pool.submit(c.update_weights_from_distributed, body) for c in clients}
                group.wait(group.broadcast(flat), what, _failed_calls(calls, what), deadline)
                for c, f in calls.items():
                    _result(c, f, what, max(0.0, deadline - time.monotonic()))
                current = following
        except (WeightSyncError, EngineError) as e:
            group.abort(str(e))
            # the engines still in the group leave it too, now: one waiting on a bucket that will
            # never come holds its step thread, and with it the pause's continue, until it does
            self.close()
            for _ in stream:  # a sharded trainer's other ranks gather every tensor: go along to the end
                pass
            if isinstance(e, EngineError):
                raise
            raise EngineError(f"weight push v{version} to {', '.join(c.url for c in clients)}: {e}") from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return {"perf/update_weights_buckets": float(nbuckets), "perf/update_weights_bytes": float(nbytes)}

    def _clients_of(self, transports: tuple[str, ...]) -> list[Any]:
        return [c for c, t in zip(self.clients, self.transports) if t in transports]

    def _backend(self) -> str:
        kinds = {t for t in self.transports if t in DISTRIBUTED}
        if len(kinds) > 1:
            raise ValueError("one weight group per run: the engines' transports mix nccl and gloo")
        return kinds.pop()

    def close(self) -> None:
        """Leave the weight group (engines forget it, so another trainer can join them later)."""
        if self._group is None:
            return
        group, self._group = self._group, None

        def leave(c: Any) -> None:  # all at once: a dead engine's refusal or timeout holds up no other
            try:
                c.destroy_weights_update_group({"group_name": GROUP_NAME})
            except EngineError as e:
                log.debug("leaving the weight group at %s: %s", c.url, e)

        self._each_client(leave, self._clients_of(DISTRIBUTED))
        group.close()


def _chain(first: tuple[str, Tensor], rest: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    yield first
    yield from rest


def _common_dtype(infos: list[dict], urls: list[str]) -> torch.dtype:
    """The dtype the engines hold their weights in (pushed in it, so no engine casts)."""
    names = {str(i.get("dtype", "bfloat16")) for i in infos}
    if len(names) != 1 or next(iter(names)) not in DTYPES:
        raise EngineError(
            f"engines at {', '.join(urls)} report weight dtypes {sorted(names)}: start them with one --dtype (float32, bfloat16 or float16)"
        )
    return DTYPES[names.pop()]


def _failed_calls(calls: dict[Any, Future], what: str) -> Callable[[], None]:
    """A check for WeightGroup.wait: raises as soon as any engine's HTTP call has failed."""

    def check() -> None:
        for client, f in calls.items():
            if f.done() and f.exception() is not None:
                _result(client, f, what, 0)

    return check


class WeightWriteError(VimeError, OSError):
    """The weights could not be written where the engines read them (shm or disk push)."""


def _write(weights: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    try:
        save_file(weights, str(path), metadata={"format": "pt"})
    except Exception as e:  # an OSError, or safetensors' own error type holding one
        path.unlink(missing_ok=True)
        if not isinstance(e, OSError) and "I/O error" not in str(e):
            raise
        detail = " ".join((getattr(e, "strerror", None) or str(e)).split())[:200]
        raise WeightWriteError(
            f"cannot write the weights for the engines to {path.parent} ({detail}): make room there "
            "(a push needs the model's size free), or choose another --weight-transport"
        ) from None


def _result(client: Any, f: Future, what: str, timeout: float) -> Any:
    """The call's answer, or an EngineError naming the engine and what it was doing."""
    try:
        return f.result(timeout=timeout)
    except FutureTimeout:
        raise EngineError(f"engine at {client.url} did not answer ({what}) in time") from None
    except EngineError as e:
        raise EngineError(f"{what}: {e}") from None

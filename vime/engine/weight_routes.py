"""The engine's weight routes: whole updates (a safetensors file in shared memory, CUDA IPC
handles, a directory on disk), bucketed updates broadcast through a trainer's weight group
(`vime/transport/group.py`), and the checksums the trainer checks a push by.

Apart from `server.py` because these are the trainer's side of the protocol, with their own
state (the weight groups this engine has joined); like every route they run engine work
through `EngineServer.call`, between two steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from vime.engine.http_common import BadRequest, body_field, read_body
from vime.transport import buckets, cuda_ipc
from vime.transport.group import WeightGroup, join


class WeightRoutes:
    """The weight routes of one engine; `call` runs a function in its engine thread."""

    def __init__(self, engine, call: Callable[[Callable[[], Any]], Awaitable[Any]]):
        self.engine = engine
        self.call = call
        self.weight_groups: dict[str, WeightGroup] = {}  # group name → this engine's membership

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """A whole update from a safetensors file in shared memory, or from CUDA IPC handles
        (plain JSON data, `vime/transport/cuda_ipc.py`: nothing in a request is ever unpickled).
        All or nothing: `LLMEngine.replace_weights`."""
        from vime.engine.core.safetensors_io import iter_safetensors_files, safetensors_layout

        body = await read_body(request)
        transport = body_field(body, "transport", str, required=False, default="shm")
        version = _weight_version(body)
        if transport == "shm":
            path = body_field(body, "path", str)
            if not Path(path).is_file():
                raise BadRequest(f"weights file {path} does not exist")
            return await self._replace_weights(
                lambda: safetensors_layout([path]), lambda: iter_safetensors_files([path]), version
            )
        if transport == "cuda_ipc":
            handles = cuda_ipc.parse(body_field(body, "handles", list))
            if self.engine.device.type != "cuda":
                raise BadRequest(
                    f"transport cuda_ipc needs a GPU engine; this one runs on {self.engine.device}: use shm"
                )
            return await self._replace_weights(
                lambda: [(h.name, h.shape, cuda_ipc.DTYPES[h.dtype]) for h in handles],
                lambda: [(h.name, h.rebuild()) for h in handles],  # every handle opened before the first copy
                version,
            )
        raise BadRequest(f"transport '{transport}': use shm or cuda_ipc")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        from vime.engine.core.safetensors_io import iter_safetensors_files, safetensors_files, safetensors_layout

        body = await read_body(request)
        path = body_field(body, "model_path", str)
        version = _weight_version(body)
        if not Path(path).is_dir():
            raise BadRequest(f"model_path {path} is not a directory")
        files = safetensors_files(path)
        return await self._replace_weights(
            lambda: safetensors_layout(files), lambda: iter_safetensors_files(files), version
        )

    async def _replace_weights(
        self, layout: Callable[[], list], tensors: Callable[[], Iterable], version: int | None
    ) -> web.Response:
        t0 = time.perf_counter()
        n = await self.call(lambda: self.engine.replace_weights(layout(), tensors, version))
        return web.json_response(
            {
                "success": True,
                "num_tensors": n,
                "weight_version": self.engine.weight_version,
                "time_s": time.perf_counter() - t0,
            }
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join a trainer's weight group (vime/transport/group.py). Blocks this engine's steps
        until every member has joined or the timeout passes; a group of the same name left by an
        earlier trainer is torn down first."""
        body = await read_body(request)
        address = body_field(body, "master_address", str)
        port = body_field(body, "master_port", int)
        rank = body_field(body, "rank_offset", int)
        world = body_field(body, "world_size", int)
        name = body_field(body, "group_name", str, required=False, default="vime-weights")
        backend = body_field(body, "backend", str, required=False, default="nccl")
        timeout = float(body_field(body, "timeout", (int, float), required=False, default=120.0))
        if backend not in ("nccl", "gloo"):
            raise BadRequest(f"backend '{backend}': use nccl or gloo")
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise BadRequest(f"backend nccl needs a GPU engine; this one runs on {self.engine.device}: use gloo")
        if not 0 < rank < world:
            raise BadRequest(
                f"rank_offset {rank} must be in [1, world_size) (rank 0 is the trainer), world_size {world}"
            )
        if timeout <= 0:
            raise BadRequest("timeout must be > 0 seconds")
        old = self.weight_groups.pop(name, None)
        if old is not None:
            old.abort("replaced by a new group of the same name")
            await self.call(lambda: self.engine.abandon_update(f"weight group '{name}' replaced"))
        group = await self.call(lambda: join(backend, address, port, rank, world, name, self.engine.device, timeout))
        self.weight_groups[name] = group
        return web.json_response(
            {"success": True, "message": f"joined weight group '{name}' as rank {rank} of {world} ({backend})"}
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive one announced bucket by broadcast from the trainer and copy it in place. The
        announced names and shapes are checked against the model before anything is received,
        so a wrong bucket is a 400 that leaves the weights untouched."""
        body = await read_body(request)
        version = _weight_version(body)
        name = body_field(body, "group_name", str, required=False, default="vime-weights")
        group = self.weight_groups.get(name)
        if group is None:
            raise BadRequest(f"no weight group '{name}': call /init_weights_update_group first")
        layout = buckets.parse_layout(
            body_field(body, "names", list), body_field(body, "dtypes", list), body_field(body, "shapes", list)
        )
        load_format = body_field(body, "load_format", str, required=False)
        if load_format not in (None, buckets.FLATTENED):
            raise BadRequest(f"load_format '{load_format}': use {buckets.FLATTENED} or leave it out")
        self.engine.check_weights([(n, s, d) for n, d, s in layout])
        flush = body_field(body, "flush_cache", bool, required=False, default=True)
        t0 = time.perf_counter()
        receive = buckets.receive(group, layout, flattened=load_format is not None)
        n = await self.call(lambda: self.engine.update_weights(receive, version, flush=flush))
        return web.json_response(
            {
                "success": True,
                "num_tensors": n,
                "weight_version": self.engine.weight_version,
                "time_s": time.perf_counter() - t0,
            }
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = body_field(await read_body(request), "group_name", str, required=False, default="vime-weights")
        group = self.weight_groups.pop(name, None)
        if group is None:
            raise BadRequest(f"no weight group '{name}'")
        await asyncio.to_thread(group.close)  # local and quick: no step needs to wait for it
        await self.call(lambda: self.engine.abandon_update(f"weight group '{name}' closed"))
        return web.json_response({"success": True})

    async def weight_checksums(self, request: web.Request) -> web.Response:
        """vime.transport.checksums (bit sum, count) of every weight the engine holds, by HF name (a tied weight under
        both names): read back from the parameters, so the trainer sees what was loaded."""
        sums = await self.call(self.engine.weight_checksums)
        return web.json_response({"weight_version": self.engine.weight_version, "checksums": sums})


def _weight_version(body: dict) -> int | None:
    """An update's weight_version: the trainer's policy version, stamped on every token, so never
    negative (absent: the engine's version + 1)."""
    version = body_field(body, "weight_version", int, required=False)
    if version is not None and version < 0:
        raise BadRequest(f"weight_version {version} is negative: give the policy version (0 or more), or leave it out")
    return version

"""The vime engine's HTTP server: `EngineServer` (engine thread + native protocol routes) and the
process entry point `python -m vime.engine.server` (what `launch.py` starts).

The engine steps in its own thread; aiohttp handlers never touch it directly. A handler puts a
command (a function of the engine) on a queue and awaits an asyncio future; the engine thread
runs commands between two steps and resolves futures with `loop.call_soon_threadsafe`. So
control operations are ordered with respect to steps without any lock, and a long step never
blocks the event loop (health checks answer while the engine works); a streamed request's
tokens come out after each step through a tap (`streams.py`). The OpenAI-compatible routes are
in `openai_api/`, the weight updates and checksums in `weight_routes.py`, the bodies of
/get_model_info and /metrics in `introspection.py`, request parsing, errors and auth in
`http_common.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import queue
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from vime.engine.http_common import (
    API_KEY_ENV,
    BadRequest,
    auth_middleware,
    body_field,
    body_limit_middleware,
    error_middleware,
    is_loopback,
    json_error,
    read_body,
)
from vime.engine.introspection import metrics_text, model_info
from vime.engine.openai_api.routes import OpenAIRoutes, ServedModel, add_openai_flags, openai_errors
from vime.engine.streams import OnTokens, Taps
from vime.engine.weight_routes import WeightRoutes
from vime.errors import VimeError
from vime.startup import StartupClock

log = logging.getLogger("vime.engine")

READY_LINE = "vime-engine ready on"  # printed once listening; `launch_engine` waits for it
# a request body's default limit: room for a prompt of the whole context as JSON token ids (at
# most 8 bytes each) or as text, and never under 1 MiB (a push's CUDA handles, a long chat)
BODY_BYTES_PER_TOKEN = 16
MIN_BODY_BYTES = 2**20


class EngineServer:
    """Owns the engine thread and the aiohttp routes."""

    def __init__(
        self,
        engine,
        model_path: str,
        api_key: str | None = None,
        max_request_mb: float | None = None,
        served_names: tuple[str, ...] = (),
        tool_call_parser: str = "hermes",
    ):
        self.engine = engine
        self.model_path = model_path
        self.api_key = api_key
        self.max_request_bytes = (
            max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * engine.max_seq_len)
            if max_request_mb is None
            else int(max_request_mb * 2**20)
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.commands: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future]] = queue.SimpleQueue()
        self.pending: dict[str, asyncio.Future] = {}  # rid → future; touched by the engine thread only
        self.fatal: str | None = None  # set if a step raised: the engine state can no longer be trusted
        self.taps = Taps()  # streamed requests; touched by the engine thread only
        served = ServedModel(model_path, (*served_names, model_path), engine.max_seq_len, tool_call_parser)
        self.openai = OpenAIRoutes(served, self._generate, self.call, engine)
        self.weights = WeightRoutes(engine, self.call)

    # ---- the engine thread -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        threading.Thread(target=self._run, name="vime-engine", daemon=True).start()

    def _run(self) -> None:
        while True:
            cmds = []
            try:  # wait for a command only when there is nothing to step
                cmds.append(self.commands.get(block=not self.engine.has_work() or self.fatal is not None))
                while True:
                    cmds.append(self.commands.get_nowait())
            except queue.Empty:
                pass
            for fn, fut in cmds:
                if self.fatal is not None:
                    self._resolve(fut, error=RuntimeError(self.fatal))
                    continue
                try:
                    self._resolve(fut, result=fn())
                except Exception as e:
                    self._resolve(fut, error=e)
            if self.fatal is None and self.engine.has_work():
                try:
                    self._deliver(self.engine.step())
                    self.taps.after_step(self.engine.requests, self.loop)
                except Exception as e:
                    log.exception("engine step failed; failing all requests")
                    self.fatal = f"engine step failed: {type(e).__name__}: {e}"
                    for fut in self.pending.values():
                        self._resolve(fut, error=RuntimeError(self.fatal))
                    self.pending.clear()
                    self.taps.clear()

    def _deliver(self, outputs: Iterable) -> int:
        """Hand each finished request to its waiting handler; returns how many were aborted (an
        abort or pause also returns the requests that the step in flight finished)."""
        n = 0
        for out in outputs:
            self.taps.drop(out.rid)
            fut = self.pending.pop(out.rid, None)
            if fut is not None:
                self._resolve(fut, result=out)
            n += any(o.finish_reason == "abort" for o in out.outputs)
        return n

    def _resolve(self, fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if fut.done():  # the HTTP handler went away (client disconnected)
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        assert self.loop is not None
        self.loop.call_soon_threadsafe(settle)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn in the engine thread between two steps and return its result."""
        fut = asyncio.get_running_loop().create_future()
        self.commands.put((fn, fut))
        return await fut

    def _submit(self, fn: Callable[[], Any]) -> None:
        """Fire and forget (used where nobody can wait, e.g. a cancelled handler)."""
        assert self.loop is not None
        self.commands.put((fn, self.loop.create_future()))

    # ---- generation --------------------------------------------------------------------

    async def _generate(
        self, input_ids: list[int], params, rid: str, on_tokens: OnTokens | None = None, routed_experts: bool = False
    ):
        """Queue one request and wait for its RequestOutput; aborts it if the caller goes away.
        `on_tokens` (streaming) gets each sample's new tokens after every step, on the event loop;
        `routed_experts`: each sample keeps the experts of its positions (`LLMEngine.add_request`)."""
        self._check_length(len(input_ids), generates=params.max_new_tokens > 0)
        fut = asyncio.get_running_loop().create_future()

        def add() -> None:
            out = self.engine.add_request(rid, input_ids, params, routed_experts)
            if out is None:
                self.pending[rid] = fut
                if on_tokens is not None:
                    self.taps.add(rid, params.n, on_tokens)
            else:
                self._resolve(fut, result=out)

        await self.call(add)
        try:
            return await fut
        except asyncio.CancelledError:
            self._submit(lambda: self._deliver(self.engine.abort(rid)))
            raise

    def _check_length(self, n: int, generates: bool = True) -> None:
        """A prompt the engine could never hold is refused here, on the HTTP thread, before its ids are
        checked or it queues for the engine thread; a scoring (nothing generated) may fill the context."""
        if n > self.engine.max_seq_len - int(generates):
            raise BadRequest(
                f"prompt of {n} tokens can never fit: the engine's maximum sequence length is {self.engine.max_seq_len}"
            )

    def _parse_generate(self, body: dict):
        from vime.engine.core.sampler import SamplingParams

        input_ids = body_field(body, "input_ids", list)
        self._check_length(len(input_ids), generates=False)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise BadRequest("input_ids must be a list of integers")
        params = SamplingParams.from_dict(body_field(body, "sampling_params", dict, required=False, default={}))
        self._check_length(len(input_ids), generates=params.max_new_tokens > 0)
        rid = body_field(body, "rid", str, required=False) or uuid.uuid4().hex
        return input_ids, params, rid, bool(body.get("return_logprob", False))

    async def generate(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        input_ids, params, rid, return_logprob = self._parse_generate(body)
        start = body_field(body, "logprob_start_len", int, required=False, default=-1)  # SGLang's; -1: not scored
        routed = body_field(body, "return_routed_experts", bool, required=False, default=False)  # SGLang's (R3)
        scored = None
        if return_logprob and start >= 0:
            from vime.engine.core.scoring import input_token_logprobs

            scored = await self.call(lambda: input_token_logprobs(self.engine, input_ids, start))
        out = await self._generate(input_ids, params, rid, routed_experts=routed)
        samples = [_sample_json(out, i, return_logprob, scored) for i in range(len(out.outputs))]
        if routed:  # off the event loop: waiting for the copies (a step at most) and encoding them
            encoded = await asyncio.to_thread(lambda: [o.routed_experts.base64() for o in out.outputs])
            for sample, routes in zip(samples, encoded):
                sample["meta_info"]["routed_experts"] = routes  # base64 of int32 [tokens - 1, MoE layers, top_k]
        return web.json_response(samples[0] if params.n == 1 else samples)

    # ---- control -----------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = body_field(await read_body(request), "mode", str, required=False, default="abort")
        if mode not in ("abort", "in_place"):
            raise BadRequest(f"pause mode '{mode}': use abort or in_place")
        n = await self.call(lambda: self._deliver(self.engine.pause(mode)))
        return web.json_response({"success": True, "aborted": n})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.call(self.engine.unpause)
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        rid = body_field(body, "rid", str, required=False)
        if rid is None and not body.get("abort_all"):
            raise BadRequest("give 'rid' or 'abort_all': true")
        n = await self.call(lambda: self._deliver(self.engine.abort(rid)))
        return web.json_response({"success": True, "aborted": n})

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self.call(self.engine.flush_cache)
        return web.json_response({"success": True})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        released = await self.call(self.engine.release_memory)
        return web.json_response({"success": True, "released_bytes": released})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        await self.call(self.engine.resume_memory)
        return web.json_response({"success": True})

    # ---- introspection -----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        problem = self.fatal or self.engine.weights_incomplete
        if problem is not None:
            return json_error(503, problem)
        return web.json_response({"status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(model_info(self.engine, self.model_path))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=metrics_text(self.engine), content_type="text/plain")

    def app(self) -> web.Application:
        middlewares = [body_limit_middleware(self.max_request_bytes, "--max-request-mb"), error_middleware]
        if self.api_key:
            middlewares.insert(0, auth_middleware(self.api_key))
        middlewares.insert(0, openai_errors)  # outermost: the /v1/ routes' errors in OpenAI's shape, a 401 too
        app = web.Application(middlewares=middlewares, client_max_size=self.max_request_bytes)
        self.openai.add_to(app)
        post = {
            "/generate": self.generate,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/abort_request": self.abort_request,
            "/flush_cache": self.flush_cache,
            "/update_weights_from_tensor": self.weights.update_weights_from_tensor,
            "/update_weights_from_disk": self.weights.update_weights_from_disk,
            "/init_weights_update_group": self.weights.init_weights_update_group,
            "/update_weights_from_distributed": self.weights.update_weights_from_distributed,
            "/destroy_weights_update_group": self.weights.destroy_weights_update_group,
            "/release_memory_occupation": self.release_memory_occupation,
            "/resume_memory_occupation": self.resume_memory_occupation,
        }
        for path, handler in post.items():
            app.router.add_post(path, handler)
        for path, handler in {
            "/health": self.health,
            "/get_model_info": self.model_info,
            "/weight_checksums": self.weights.weight_checksums,
            "/metrics": self.metrics,
        }.items():
            app.router.add_get(path, handler)
        return app


def _sample_json(out, i: int, return_logprob: bool, input_logprobs: list | None = None) -> dict:
    """One sample's answer; `input_logprobs`: the scored input (scoring.input_token_logprobs)."""
    o = out.outputs[i]
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": {"type": o.finish_reason},
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(o.output_ids),
        "weight_version": out.weight_version,
        "output_weight_versions": o.weight_versions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = o.logprobs
    if input_logprobs is not None:
        meta["input_token_logprobs"] = input_logprobs
    return {"output_ids": o.output_ids, "meta_info": meta}


# ---- process entry point ---------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vime.engine.server", description="the vime rollout engine (HTTP)")
    p.add_argument("--model-path", required=True, help="HF model directory (or 'smollm2' / 'tiny')")
    p.add_argument("--host", default="127.0.0.1", help="an address other than loopback needs --api-key")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"token every route but /health requires (Authorization: Bearer); default: ${API_KEY_ENV}, which keeps it out of the process list",
    )
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--num-kv-blocks", type=int, default=None, help="default: from --kv-cache-gb, or a share of free GPU memory"
    )
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.5,
        help="GPU: share of the memory free after loading weights",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (prompt + output); default: the model's max_position_embeddings",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly (debugging)")
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="book each step before launching the next (SGLang's name); by default the host books step N "
        "while the GPU computes step N+1 (debugging)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-for-file", metavar="PATH", help="size the KV cache from free memory once PATH exists")
    fp8 = "fp8: the projections run W8A8 (per-channel weight, per-token activation scales), requantized at each update"
    p.add_argument(
        "--quantization", choices=["fp8"], help=fp8 + "; embeddings and lm_head stay in --dtype (GPU: bf16, sm89+)"
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=None,
        help=f"largest request body in MiB, refused with 413 beyond (default: {BODY_BYTES_PER_TOKEN} bytes per token of the "
        f"longest sequence, at least {MIN_BODY_BYTES // 2**20} MiB: a prompt of the whole context fits)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: half the cores, the trainer needs the rest)",
    )
    add_openai_flags(p)
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (set by launch_engine)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    _refuse_out_of_range(p, args)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not args.api_key and not is_loopback(args.host):
        p.error(
            f"--host {args.host} would let anyone who reaches it change the weights: set --api-key (or ${API_KEY_ENV}), or bind 127.0.0.1"
        )
    return args


def _refuse_out_of_range(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each number of the command line in its range, as argparse's usage and one line (exit 2),
    before the model loads."""
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port}: give 0-65535 (0 picks a free port)")
    for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")  # usage, then one line; exit 2
    if args.max_request_mb is not None and not args.max_request_mb > 0:
        p.error(f"--max-request-mb {args.max_request_mb}: give a size in MiB above 0")
    # NaN and -1 ended the start in a traceback (sizing the cache), 0 was taken as "not given"
    for name in ("num_kv_blocks", "max_model_len", "num_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1 (leave it out for the default)")
    if args.kv_cache_gb is not None and not (math.isfinite(args.kv_cache_gb) and args.kv_cache_gb > 0):
        p.error(f"--kv-cache-gb {args.kv_cache_gb}: give a size in GB above 0")
    if not 0 < args.kv_cache_memory_fraction <= 1:  # NaN fails it too
        p.error(
            f"--kv-cache-memory-fraction {args.kv_cache_memory_fraction}: a share of the free GPU memory, in (0, 1]"
        )


def main(argv: list[str] | None = None) -> None:
    clock = StartupClock()  # from the process's start: its imports are the first phase
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.models import resolve_model

    torch.set_num_threads(args.num_threads or max(1, (os.cpu_count() or 2) // 2))
    model_path = str(resolve_model(args.model_path))
    try:  # before the model loads: a port in use is known at once, not after a minute of loading
        sock = socket.create_server(
            (args.host, args.port), family=socket.AF_INET6 if ":" in args.host else socket.AF_INET
        )
    except OSError as e:
        raise VimeError(
            f"cannot listen on {args.host}:{args.port} ({(e.strerror or str(e)).split(' (while')[0]}): pick another --port (0 picks a free one)"
        ) from None
    dtype = args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
    # the flags named as EngineConfig's fields
    same = "max_num_seqs num_kv_blocks kv_cache_gb kv_cache_memory_fraction block_size max_num_batched_tokens"
    same += " max_model_len seed quantization wait_for_file parent_pid"
    engine = LLMEngine(
        EngineConfig(
            model_path=model_path,
            device=args.device,
            dtype=dtype,
            cuda_graphs=not args.enforce_eager,
            overlap=not args.disable_overlap_schedule,
            **{name: getattr(args, name) for name in same.split()},
        )
    )
    clock.phases += engine.startup
    log.info("%s", clock.line("before serving"))
    names = (*args.served_model_name, args.model_path)  # the name as given ('tiny', a hub id), then the directory
    server = EngineServer(engine, model_path, args.api_key, args.max_request_mb, names, args.tool_call_parser)
    asyncio.run(_serve(server, sock, args.host, args.parent_pid))


async def _serve(server: EngineServer, sock: socket.socket, host: str, parent_pid: int | None) -> None:
    loop = asyncio.get_running_loop()
    server.start(loop)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts the request.
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    print(f"{READY_LINE} http://{url_host}:{port}", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if parent_pid is None:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    else:
        # an engine a run started is the run's to stop: Ctrl-C reaches the whole process group,
        # and an engine that quit first made the trainer end on "engine unreachable" instead of
        # "interrupted" (as reward workers, it goes when the run closes it or its parent dies)
        loop.add_signal_handler(signal.SIGINT, lambda: None)
    while not stop.is_set():
        if parent_pid is not None and os.getppid() != parent_pid:
            log.info("parent process %d is gone; shutting down", parent_pid)
            break
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            pass
    if server.fatal is None:  # answer whoever is still waiting (partial outputs, finish reason abort)
        await server.call(lambda: server._deliver(server.engine.abort()))
    await runner.cleanup()


if __name__ == "__main__":
    main()

"""The engine: requests in, one batched model step at a time, finished requests out.

Single-threaded by design: the server calls every method from its one engine thread, so
control operations (abort, pause, weight update) always fall between two steps and need no
locks. Every generated token is stamped with the weight version that produced it.

Steps overlap (on the Triton path): `step` launches step N+1 before it books step N, so the
host's scheduling, staging and booking run while the device computes. Step N's tokens are
not known when N+1 is scheduled: each sequence holds a PENDING placeholder for its newest token,
which N+1's decode gathers on the device. A sequence that N's token ends (a stop token) has
computed one row in N+1 for nothing; one that its length ends is not scheduled again. A step
that is not a pure decode (a prefill, a recomputation) and every control operation first wait
for the step in flight (`_drain`), so no host code ever reads a placeholder.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from vime.engine.core import fp8, vmem
from vime.engine.core.kv_cache import BlockAllocator, KVCache, wait_for_file
from vime.engine.core.lora import AdapterMerger, adapter_of
from vime.engine.core.model import CausalLM, load_model
from vime.engine.core.requests import EngineStats, Request, RequestOutput
from vime.engine.core.routing import read_routes
from vime.engine.core.runner import Launched, ModelRunner
from vime.engine.core.sampler import M32, SamplingParams, mix32
from vime.engine.core.scheduler import PENDING, Scheduler, Sequence
from vime.engine.core.stop import StopStrings
from vime.engine.core.weights import WeightsIncomplete, check_layout

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_GB = 1.0  # default KV budget on CPU, where memory is shared with the trainer


@dataclass
class EngineConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 64
    num_kv_blocks: int | None = None  # None: from --kv-cache-gb, or a share of free GPU memory
    kv_cache_gb: float | None = None
    kv_cache_memory_fraction: float = 0.5  # of the GPU memory free after loading the weights
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings (and what the cache holds)
    cuda_graphs: bool = True  # capture decode steps on CUDA (False: every step eager, for debugging)
    overlap: bool = True  # launch a step before booking the previous one (False: one step at a time, for debugging)
    seed: int = 0
    # a file to wait for after loading the weights and before sizing the KV cache from free GPU memory: a
    # trainer on the same GPU, building while this engine starts, creates it at its peak (vime/launch/assemble.py)
    wait_for_file: str | None = None
    parent_pid: int | None = None  # whose end ends that wait (the run that launched this engine)
    quantization: str | None = None  # "fp8": the layers' projections run W8A8 from fp8 copies (fp8.py)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        if cfg.dtype not in DTYPES:
            raise ValueError(f"--dtype {cfg.dtype}: use one of {', '.join(DTYPES)}")
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        fp8.check(cfg.quantization, self.device, self.dtype, cfg.model_path)  # before a minute of loading
        t0 = time.monotonic()
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # kernels and allocations default to the engine's GPU
        # CUDA with VMM: weights and KV pools keep their addresses through a release (vmem.py), as do the graphs
        self.packed: vmem.PackedWeights | None = None
        self.model = load_model(
            cfg.model_path, self.device, self.dtype, self._pack_weights if vmem.supported(self.device) else None
        )
        mc = self.model_config = self.model.config
        # before the KV cache is sized: the fp8 copies take device memory too
        self.fp8 = fp8.Fp8Weights(self.model, self.device, self.packed is not None) if cfg.quantization else None
        # this start's phases in seconds, for the server's start-up line (issue 48)
        self.startup: list[tuple[str, float]] = [("CUDA and weights", time.monotonic() - t0)]
        if cfg.wait_for_file and not cfg.num_kv_blocks and cfg.kv_cache_gb is None:
            t0 = time.monotonic()
            wait_for_file(cfg.wait_for_file, cfg.parent_pid)
            self.startup.append(("waiting for the trainer", time.monotonic() - t0))
        t0 = time.monotonic()
        num_blocks = cfg.num_kv_blocks or self._auto_num_blocks()
        if num_blocks < 1:
            raise ValueError(
                "the KV cache has no room for a single block: lower --max-num-seqs or raise --kv-cache-gb / --num-kv-blocks"
            )
        if cfg.max_num_seqs > num_blocks:  # each running sequence holds a block: no more run at once
            log.warning(
                "--max-num-seqs %d: the KV cache's %d blocks run that many at most", cfg.max_num_seqs, num_blocks
            )
            cfg = self.cfg = replace(cfg, max_num_seqs=num_blocks)
        self.kv_cache = KVCache.for_model(
            mc, num_blocks, cfg.block_size, self.dtype, self.device, self.packed is not None
        )
        self.allocator = BlockAllocator(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        # A sequence may never outgrow the positions the model knows, the configured limit or the whole cache.
        self.max_seq_len = min(
            mc.max_position_embeddings, cfg.max_model_len or mc.max_position_embeddings, num_blocks * cfg.block_size
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, cfg.block_size, cfg.max_num_seqs, self.max_seq_len, self.device, cfg.cuda_graphs
        )
        self.runner.capture()
        self.startup.append(("KV cache and CUDA graphs", time.monotonic() - t0))
        self.overlap = cfg.overlap and self.runner.kernels
        self._inflight: Launched | None = None  # the step launched and not yet booked
        self._backlog: list[RequestOutput] = []  # finished while a control operation drained a step
        self.requests: dict[str, Request] = {}
        self._views: dict[str, torch.Tensor] | None = None
        self.weight_version = 0
        self.weights_incomplete: str | None = None  # why the weights are a mix (a failed update)
        self._update_open = False  # buckets of an update arrived, its last one (flush) not yet
        self.lora = AdapterMerger()  # LoRA adapters pushed on their own (vime/engine/core/lora.py)
        self.paused = False
        self.stats = EngineStats()
        self._rng = random.Random(cfg.seed)  # seeds of requests that bring no sampling_seed
        self.stop_strings = StopStrings(lambda: _load_tokenizer(cfg.model_path))
        log.info(
            "engine: %s %s on %s, %d KV blocks of %d tokens, max sequence length %d",
            mc.model_type,
            cfg.dtype + (f" with {cfg.quantization} projections" if cfg.quantization else ""),
            self.device,
            num_blocks,
            cfg.block_size,
            self.max_seq_len,
        )

    def _pack_weights(self, model: CausalLM) -> None:
        self.packed = vmem.PackedWeights(model, self.device)

    def _auto_num_blocks(self) -> int:
        mc, cfg = self.model_config, self.cfg
        per_block = KVCache.bytes_per_block(mc, cfg.block_size, self.dtype)
        if cfg.kv_cache_gb is not None:
            budget = cfg.kv_cache_gb * 2**30
        elif self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * cfg.kv_cache_memory_fraction
        else:  # enough for max_num_seqs full-length sequences, within the CPU budget
            full = (
                cfg.max_num_seqs * -(-(cfg.max_model_len or mc.max_position_embeddings) // cfg.block_size) * per_block
            )
            budget = min(full, CPU_KV_CACHE_GB * 2**30)
        return int(budget // per_block)

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, routed_experts: bool = False
    ) -> RequestOutput | None:
        """Queue a request (n sequences). Returns its output at once if there is nothing to
        generate (max_new_tokens == 0). Raises ValueError for a request that can never run.
        `routed_experts`: each sample comes back with the experts of its positions (`routing.py`)."""
        if routed_experts and self.model_config.moe is None:
            raise ValueError(
                f"return_routed_experts: the model has no experts ({self.model_config.model_type} is dense)"
            )
        if self.weights_incomplete is not None:
            raise WeightsIncomplete(self.weights_incomplete)
        if rid in self.requests:
            raise ValueError(f"request id '{rid}' is already in flight")
        self.check_token_ids(prompt_ids)
        if any(t >= self.model_config.vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias names a token id past the vocabulary ({self.model_config.vocab_size} ids)")
        if params.n > self.cfg.max_num_seqs:  # each sample is a sequence held in memory until it finishes
            raise ValueError(
                f"n {params.n} is more samples than this engine runs at once (--max-num-seqs {self.cfg.max_num_seqs}): send several requests"
            )
        if len(prompt_ids) > self.max_seq_len - int(params.max_new_tokens > 0):  # a scoring may fill the context
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens can never fit: the engine's maximum sequence length is {self.max_seq_len} "
                f"(max_position_embeddings {self.model_config.max_position_embeddings}, KV cache {self.allocator.num_blocks} blocks x {self.cfg.block_size})"
            )
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model_config.eos_token_ids))
        if params.stop:
            self.stop_strings.ready()
        seqs = []
        for j in range(params.n):
            # A sampling_seed fixes the draws of sample j of this request; otherwise the engine's
            # seeded RNG picks one (reproducible for the same arrival order).
            given = params.sampling_seed
            seed = mix32(mix32(given & M32) ^ j) if given is not None else self._rng.getrandbits(32)
            seqs.append(Sequence(rid, list(prompt_ids), len(prompt_ids), params, frozenset(stop), seed=seed))
        req = Request(rid, len(prompt_ids), seqs, routed_experts)
        if params.max_new_tokens == 0:
            for s in seqs:
                s.finish_reason = "length"
                self._end(req, s)  # nothing was computed: its routing rows are -1
            return req.output(self.weight_version)
        self.requests[rid] = req
        self.stats.prompt_tokens += len(prompt_ids) * params.n
        for s in seqs:
            self.scheduler.add(s)
        return None

    def check_token_ids(self, token_ids: list[int]) -> None:
        """A ValueError (an HTTP 400) for input ids the model cannot embed, before they reach it."""
        if not token_ids:
            raise ValueError("input_ids is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"input_ids must be integers in [0, {vocab})")

    def has_work(self) -> bool:
        return (
            self._inflight is not None
            or bool(self._backlog)
            or (self.may_step() and bool(self.scheduler.waiting or self.scheduler.running))
        )

    def may_step(self) -> bool:
        """No token comes from mixed weights: requests wait while a bucketed update is open
        (some buckets copied, its last one not yet) and after one failed part-way."""
        return not self.paused and self.kv_cache.allocated and self.weights_incomplete is None and not self._update_open

    def step(self) -> list[RequestOutput]:
        """Launch one model step and book the one before it (without overlap: this one); returns
        the requests that finished."""
        outs, self._backlog = self._backlog, []
        if not self.may_step():
            return outs + self._book_inflight()
        if self._inflight is not None and self.scheduler.outranked():  # a seat changes hands between steps only
            outs += self._book_inflight()
        scheduled = self.scheduler.schedule(preempt=self._inflight is None)
        if scheduled is None:  # blocks are short: the step in flight may end sequences that hold some
            outs += self._book_inflight()
            scheduled = self.scheduler.schedule()
        if self._inflight is not None and not (scheduled and self.runner.is_decode(scheduled)):
            # this step reads tokens, or there is none: the one in flight first
            outs += self._book_inflight()
            scheduled = [(s, n) for s, n in scheduled if s.finish_reason is None]
        if not scheduled:
            return outs
        launched = self.runner.launch(scheduled, self._inflight)
        self.stats.steps += 1
        for seq, n in scheduled:
            seq.num_computed += n
            self.stats.computed_tokens += n
        for seq in launched.seqs:
            launched.index.append(seq.num_tokens)
            seq.token_ids.append(PENDING)
            if self._at_length_limit(seq, seq.num_tokens):
                self.scheduler.retire(seq)  # whatever the token, the sequence ends with it
        outs += self._book_inflight()
        self._inflight = launched
        if not self.overlap:
            outs += self._book_inflight()
        return outs

    def _at_length_limit(self, seq: Sequence, num_tokens: int) -> bool:
        return num_tokens - seq.prompt_len >= seq.params.max_new_tokens or num_tokens >= self.max_seq_len

    def _book_inflight(self) -> list[RequestOutput]:
        """Wait for the step in flight and put its tokens in their sequences; returns the
        requests it finished."""
        step, self._inflight = self._inflight, None
        if step is None:
            return []
        done: dict[str, Request] = {}
        for seq, i, tok, lp in zip(step.seqs, step.index, *step.result()):
            if seq.finish_reason is not None:  # ended by the step before (a stop token), or aborted
                continue
            seq.token_ids[i] = tok
            seq.logprobs.append(lp)
            seq.weight_versions.append(self.weight_version)
            self.stats.generated_tokens += 1
            if tok in seq.stop_ids or (seq.params.stop and self.stop_strings.completed(seq, seq.params.stop, i + 1)):
                seq.finish_reason = "stop"
            elif self._at_length_limit(seq, i + 1):
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                del seq.token_ids[i + 1 :]  # a placeholder of the step launched after this one
                req = self.requests[seq.rid]
                self._end(req, seq)
                if req.finished:
                    done[seq.rid] = req
        outs = []
        for rid, req in done.items():
            del self.requests[rid]
            self.stats.finished_requests += 1
            outs.append(req.output(self.weight_version))
        return outs

    def _drain(self) -> None:
        """Book the step in flight before a control operation changes what it depends on; the
        requests it finishes come out of the next `step`."""
        self._backlog += self._book_inflight()

    def _end(self, req: Request, seq: Sequence) -> None:
        """Take an ended sequence out and give its blocks back; where its request asked for the
        experts, they are read from those blocks first."""
        if req.routed_experts:
            req.routes[req.seqs.index(seq)] = read_routes(self.kv_cache, seq, self.cfg.block_size)
        self.scheduler.remove(seq)

    # ---- control -----------------------------------------------------------------------

    def abort(self, rid: str | None = None) -> list[RequestOutput]:
        """Abort one request (unknown ids are ignored: it may have just finished) or, with
        rid=None, all; returns their partial outputs with finish reason abort, and the requests
        that the step in flight finished."""
        self._drain()
        rids = list(self.requests) if rid is None else [rid] if rid in self.requests else []
        # the drain's finished requests go out with this answer: their ids are free again now
        outs, self._backlog = self._backlog, []
        for r in rids:
            req = self.requests.pop(r)
            for s in req.seqs:
                if s.finish_reason is None:
                    self._end(req, s)
                    s.finish_reason = "abort"
            self.stats.aborted_requests += 1
            outs.append(req.output(self.weight_version))
        return outs

    def pause(self, mode: str = "abort") -> list[RequestOutput]:
        """Stop stepping. mode=abort also aborts everything in flight (partial outputs returned);
        in_place keeps requests and their KV, to continue after e.g. a weight update. Either way
        the requests the step in flight finished are returned too."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode '{mode}': use abort or in_place")
        self._drain()
        self.paused = True
        if mode == "abort":
            return self.abort()
        outs, self._backlog = self._backlog, []
        return outs

    def unpause(self) -> None:
        self.paused = False

    def replace_weights(
        self,
        layout: list[tuple[str, tuple[int, ...], torch.dtype | str]],
        tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        weight_version: int | None = None,
    ) -> int:
        """A whole update (from disk, shared memory or CUDA IPC): all or nothing. The announced
        layout must name every weight of the model, each once, in its shape and a float dtype
        (or be LoRA adapters only, each with both halves: `vime/engine/core/lora.py`); it is
        checked before `tensors()` is asked for anything, so a wrong update (another
        architecture, a missing shard, only `lm_head`) leaves weights and version untouched."""
        self.check_weights(layout, complete=True)
        return self.update_weights(tensors(), weight_version)

    @torch.no_grad()
    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: int | None = None, flush: bool = True
    ) -> int:
        """Copy HF-named tensors into the model in place; cached prefixes computed with the old
        weights are forgotten (`flush=False`: not yet, more buckets of the same update follow).
        Returns the number of tensors loaded.

        Callers check the update first (`replace_weights`, `check_weights`), so what can still
        fail here is reading the data (an I/O error, a broadcast whose sender died). If that
        happens after a tensor was copied, or between two buckets of one update, the weights
        are a mix: the engine says so (`weights_incomplete`) and generates nothing until an
        update completes, rather than sample from weights that no trainer ever had."""
        self._drain()  # the tokens in flight were drawn with the weights before this update
        copied = adapters = 0
        views = self._weight_views()

        def plain() -> Iterable[tuple[str, torch.Tensor]]:
            """The plain weights, for the model; adapters go to the merger on the way."""
            nonlocal copied, adapters
            for name, tensor in weights:
                copied += 1
                if adapter_of(name) is not None:
                    adapters += self.lora.load([(name, tensor)], views)
                    continue
                if self.lora.base:  # plain weights: the base adapters merge into from now on
                    self.lora.reset()
                yield name, tensor

        try:
            n = len(self.model.load_weights(plain(), views))
            if flush and self.lora.pending:
                raise ValueError(f"the update ended with half an adapter: {', '.join(self.lora.unpaired()[:3])}")
            n += adapters
        except BaseException as e:
            self.lora.pending.clear()
            if copied or self._update_open:
                why = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())[:200]
                self.weights_incomplete = (
                    f"a weight update failed part-way ({type(e).__name__}: {why}), so the weights mix two versions: "
                    "push a complete update"
                )
                log.error("%s", self.weights_incomplete)
                if isinstance(e, (ValueError, KeyError)):  # the update's own fault, a 400: it says what it left
                    raise ValueError(
                        f"{why}; the update was part-copied, so this engine now refuses generation (HTTP 503) "
                        "until a complete update arrives"
                    ) from None
            raise
        finally:
            if flush:
                self.allocator.flush()
        self._update_open = not flush
        if flush:
            self.weights_incomplete = None
            if self.fp8 is not None:  # the update is complete (merged adapters too): the fp8 copies follow it
                self.fp8.requantize()
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        return n

    def abandon_update(self, reason: str) -> None:
        """The sender of a bucketed update left before its last bucket (its weight group was
        torn down): the buckets that arrived are a part of the weights, not a version."""
        if self._update_open:
            self._update_open = False
            self.weights_incomplete = (
                f"a bucketed weight update stopped before its last bucket ({reason}): push a complete update"
            )
            log.error("%s", self.weights_incomplete)

    def check_weights(
        self, layout: Iterable[tuple[str, tuple[int, ...], torch.dtype | str]], complete: bool = False
    ) -> None:
        """The announced `layout` against this model, before anything is received or read
        (`check_layout`)."""
        check_layout(layout, self._weight_views(), self.model, self.lora, complete)

    def weight_checksums(self) -> dict[str, list[int]]:
        """vime.transport.checksums (bit sum, count) of every weight by HF name, read back from the parameters."""
        return {**self.model.checksums(self._weight_views()), **self.lora.merged}

    def _weight_views(self) -> dict[str, torch.Tensor]:
        """HF name → parameter (or fused slice), built once: a bucketed push looks names up per
        bucket. Rebuilt after release/resume, which move the parameters between device and host."""
        if self._views is None:
            self._views = self.model.named_weights()
        return self._views

    def flush_cache(self) -> None:
        self._drain()
        self.allocator.flush()

    def release_memory(self) -> int:
        """Free the KV pool and, on GPU, move the weights to host memory, so a colocated trainer can use
        the device; returns the bytes given back. Running sequences go back to waiting and are
        recomputed on resume. A weight update while released lands in the host copy and comes back.

        With VMM (`self.packed`) that is one copy of all weights into a pinned host buffer and
        two unmaps; the addresses stay, and so do the CUDA graphs. Without it, every parameter
        moves on its own and the graphs, which would point at freed storage, are dropped."""
        self._drain()
        released = sum(p.nbytes for p in self.model.parameters() if p.is_cuda)  # none once released
        if self.kv_cache.allocated:
            self.scheduler.preempt_all()
            self.allocator.flush()
            if self.packed is None:
                self.runner.drop_graphs()
            released += self.kv_cache.release()
        if self.packed is not None:
            self.packed.release()
        elif self.device.type == "cuda":
            for p in self.model.parameters():
                p.data = p.data.to("cpu")
        if self.fp8 is not None:
            released += self.fp8.release()
        released += self.lora.to("cpu")
        self._views = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the caching allocator's free blocks (live graphs keep their pool)
        return released

    def resume_memory(self) -> None:
        """Weights and KV pools back on the device: at the same addresses with VMM, else in new
        storage, for which the decode graphs are captured again. Each part that is back already
        is left alone, so a resume that failed (out of memory) can be retried."""
        if self.packed is not None:
            self.packed.restore()
        elif self.device.type == "cuda":
            for p in self.model.parameters():
                p.data = p.data.to(self.device)
        if self.fp8 is not None:
            self.fp8.restore()  # from the weights as restored, so an update while released is in
        self.lora.to(self.device)
        self._views = None
        if not self.kv_cache.allocated:
            self.kv_cache.allocate()
            if self.packed is None:
                self.runner.capture()


def _load_tokenizer(model_path: str) -> Any:
    from vime.models import load_tokenizer

    return load_tokenizer(model_path)

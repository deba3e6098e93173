"""Trainer ranks: start them, and drive them all from rank 0 with the one-process Actor API.

The driver loop runs on rank 0 and calls `train_step`, `compute_log_probs`, `named_weights`,
`save`, `load` as if the trainer were one process. `DistributedActor` sends each
call (method name and arguments, pickled, over a gloo group) to the other ranks, then makes it
locally; every rank then runs the same Actor method on the same batch, which is SPMD. Ranks
come from `torch.multiprocessing` (one machine, `python train.py`), from `torchrun` (any
number of machines: RANK/WORLD_SIZE/MASTER_ADDR are set, and ranks other than 0 never return
from `launch_actor`), or elsewhere by a launcher that hands `launch_actor` its `start_ranks`
(`--launcher ray`: actors a Ray cluster places, `vime/launch/ray_ranks.py`). The launcher
imports this module, never the reverse.

World size: `--actor-num-nodes × --actor-num-gpus-per-node` on CUDA; on CPU `actor_num_procs`
(a test and CI knob; default 1), since CPU "GPUs per node" means nothing. On CUDA even one rank
gets a process group, because FSDP2's mixed precision (bf16 compute, float32 master weights
and optimizer state) is how the trainer runs there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from vime.config import Config, PlacementConfig
from vime.errors import VimeError
from vime.lifetime import PARENT_POLL_S, exit_with_parent, leave
from vime.trainer.actor import Actor
from vime.transport.group import apply_gpu_safe_env

log = logging.getLogger("vime")

TIMEOUT = timedelta(minutes=30)  # a rank waits this long for the others (long rollouts included)
RANK_GONE_S = 3.0  # after a failed collective, how long to look for the rank that ended


class TrainerRankError(VimeError, RuntimeError):
    """Another trainer rank died or failed: one line naming it, instead of gloo's or NCCL's error."""


# Starts ranks 1..world-1 somewhere else (args, world, model_dir, device, log_dir); returns them
# (watched as processes are: is_alive, join, terminate, kill, ended_how), the `init_method` rank 0
# joins with, and what frees the resources they were placed on once they are done.
RankStarter = Callable[[Config, int, str, str, Path | None], tuple[list[Any], str, Callable[[], None]]]


def world_size(placement: PlacementConfig, device: str) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if torch.device(device).type == "cuda":
        return placement.actor_num_nodes * placement.actor_num_gpus_per_node
    return placement.actor_num_procs


def launch_actor(
    args: Config,
    model_dir: str | Path,
    device: str = "cpu",
    tokenizer: Any = None,
    log_dir: Path | None = None,
    start_ranks: RankStarter | None = None,
) -> Actor | DistributedActor:
    """The trainer for this run, as seen by the driver.

    One CPU process: a plain `Actor`. Otherwise a `DistributedActor` on rank 0, after
    spawning ranks 1..N-1 here, or having `start_ranks` start them elsewhere (the Ray
    launcher's `start_ray_ranks`), or joining the ones torchrun started. On a torchrun rank
    other than 0 this serves rank 0's calls until it closes, then exits the process.
    `tokenizer`: the run's, for rank 0 (the other ranks load their own). `log_dir`: where ranks
    started elsewhere write their output (the run directory).
    """
    world = world_size(args.placement, device)
    is_cuda = torch.device(device).type == "cuda"
    apply_gpu_safe_env()  # before any NCCL communicator, and inherited by the ranks spawned below
    if world == 1 and not is_cuda:
        return Actor(args, model_dir, device, tokenizer=tokenizer)
    procs: list[Any] = []
    release = None
    if "RANK" in os.environ:  # torchrun: every rank runs the driver script up to here
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        _init(rank, world, "env://", device, local)
        if rank != 0:
            try:
                _serve(args, model_dir, _rank_device(device, local))
            except Exception as e:  # one line for the command to print, not a traceback (gloo's, say)
                raise TrainerRankError(f"trainer rank {rank} stopped: {_cause(e)}") from None
            sys.exit(0)
    elif start_ranks is not None and world > 1:
        procs, init_method, release = start_ranks(args, world, str(model_dir), device, log_dir)
        try:
            _init_watching(procs, world, init_method, device)
        except BaseException:
            for p in procs:
                p.kill()
            release()
            raise
    else:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA context or threads inherited
        for rank in range(1, world):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, world, init_method, args, str(model_dir), device, os.getpid(), writer),
                daemon=True,
            )
            p.start()
            writer.close()
            p.last_words = reader  # why it failed, one line, sent before it exits (`_ended_how`)
            procs.append(p)
        _init(0, world, init_method, device, 0)
    return DistributedActor(
        args, model_dir, _rank_device(device, int(os.environ.get("LOCAL_RANK", 0))), procs, tokenizer, release
    )


class DistributedActor:
    """Rank 0's handle on all trainer ranks; same methods as `Actor`.

    Each method call is broadcast to the other ranks first, then run here; collectives inside
    the Actor keep the ranks together. Attributes not defined here (model, tokenizer, args)
    are rank 0's Actor's.
    """

    def __init__(
        self,
        args: Config,
        model_dir: str | Path,
        device: str,
        procs: list[Any],
        tokenizer: Any = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.release = release  # frees what the ranks were placed on (a Ray placement group)
        self.cpu_group = _cpu_group()
        self.local = Actor(args, model_dir, device, fsdp=True, cpu_group=self.cpu_group, tokenizer=tokenizer)
        self.procs = procs
        self._closed = False
        # the call this rank left before its end (Ctrl-C, SIGTERM, a dead rank): the other ranks
        # are then somewhere inside it, in a collective no "close" would ever match
        self._broken_off: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["local"], name)

    @contextlib.contextmanager
    def _together(self, name: str) -> Iterator[None]:
        """The ranks are in step after the block only if it ends normally. A rank that is gone
        turns the collective's error into one line naming it."""
        self._broken_off = name
        try:
            yield
        except RuntimeError as e:  # gloo and NCCL raise dist.DistError, a RuntimeError
            failure = self._rank_failure(name, e)
            if failure is None:
                raise
            raise failure from None
        self._broken_off = None

    def _rank_failure(self, name: str, error: BaseException) -> TrainerRankError | None:
        # a collective fails as soon as a peer's socket closes; the cluster may see the rank's end
        # a moment later (a Ray actor's death takes its raylet's word)
        deadline = time.monotonic() + RANK_GONE_S
        while not (dead := [(r, p) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]):
            if not self.procs or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if dead:
            rank, p = dead[0]
            how = _ended_how(p)
            return TrainerRankError(
                f"trainer rank {rank} ended ({how}) during {name}: resume the run with --load from its last checkpoint"
            )
        # under torchrun the ranks are not ours to watch (DistError: torch >= 2.3)
        if isinstance(error, getattr(dist, "DistError", ())):
            first = " ".join(str(error).split())[:300]
            return TrainerRankError(f"a trainer rank failed during {name} ({first}): see that rank's log")
        return None

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._together(name):
            dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self.cpu_group)
            return getattr(self.local, name)(*args, **kwargs)

    def train_step(self, samples: list, advantages: torch.Tensor, step_size: int | None = None) -> dict[str, float]:
        return self._call("train_step", samples, advantages, step_size)

    def compute_log_probs(self, samples: list) -> list[torch.Tensor]:
        return self._call("compute_log_probs", samples)

    def skip_steps(self, n: int) -> None:
        return self._call("skip_steps", n)

    def named_weights(self, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, one at a time; iterate to the end (the other ranks gather with you)."""
        weights = self._call("named_weights", merge)
        with self._together("named_weights"):  # the gathers happen as the caller iterates
            yield from weights

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA adapters as a push sends them; iterate to the end, as with `named_weights`."""
        weights = self._call("adapter_weights")
        with self._together("adapter_weights"):
            yield from weights

    def save(self, ckpt_dir: str | Path, extra_state: dict[str, Any]) -> Path:
        return self._call("save", ckpt_dir, extra_state)

    def load(self, ckpt_dir: str | Path) -> dict[str, Any]:
        return self._call("load", ckpt_dir)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent). Ranks in step are told
        to close; ranks left inside a call (this rank broke off it) are ended with SIGTERM, as
        waiting for them would last the collective timeout (30 min)."""
        if self._closed:
            return
        self._closed = True
        self.local.close()  # a warm-up compiling on its thread stops before the group goes
        if self._broken_off is None:
            try:
                dist.broadcast_object_list([("close", (), {})], src=0, group=self.cpu_group)
            except RuntimeError as e:  # a rank is gone; end the rest below
                log.debug("telling the trainer ranks to close: %r", e)
                self._broken_off = "close"
        for p in self.procs:
            p.join(timeout=60 if self._broken_off is None else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if self.release is not None:
            try:
                self.release()
            except Exception as e:  # a cluster already gone has nothing to give back
                log.warning("removing the trainer ranks' placement group: %s", " ".join(str(e).split())[:200])
        # NCCL kernels left waiting on a rank now gone may block the teardown; gloo has none pending
        if self._broken_off is None or dist.get_backend() == "gloo":
            dist.destroy_process_group()


def _init_watching(ranks: list[Any], world: int, init_method: str, device: str) -> None:
    """Rank 0 joins the group while watching ranks started elsewhere (Ray actors): one that ends
    before it joins (its node cannot write the run's log, an import or CUDA error) is one line at
    once, not the group's 30-minute wait."""
    failed: list[BaseException] = []

    def join() -> None:
        try:
            _init(0, world, init_method, device, 0)
        except BaseException as e:  # noqa: BLE001 (raised again below, in the caller's thread)
            failed.append(e)

    t = threading.Thread(target=join, name="vime-join-trainer-group", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.5)
        gone = [(rank, p) for rank, p in enumerate(ranks, start=1) if t.is_alive() and not p.is_alive()]
        if gone:
            rank, p = gone[0]
            raise TrainerRankError(f"trainer rank {rank} ended before joining the trainer's group: {_ended_how(p)}")
    if failed:
        raise failed[0]


def _ended_how(p: Any) -> str:
    """How a rank ended: a Ray rank says (`RayRank.ended_how`), a process has its exit code and
    what it sent before it exited (`_worker`)."""
    if hasattr(p, "ended_how"):
        return p.ended_how()
    code = p.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    words = getattr(p, "last_words", None)
    if words is not None and not isinstance(words, str):  # read once; the next call's line says the same
        try:
            p.last_words = words.recv() if words.poll() else ""
        except (EOFError, OSError):
            p.last_words = ""
        words.close()
    return f"{how}: {p.last_words}" if getattr(p, "last_words", "") else how


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _rank_device(device: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if torch.device(device).type == "cuda" else "cpu"


def _init(rank: int, world: int, init_method: str, device: str, local_rank: int) -> None:
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl" if is_cuda else "gloo", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT
    )


def _cpu_group() -> Any:
    """A gloo group for pickled calls and metrics: on NCCL they would bounce through the GPU."""
    return dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world: int,
    init_method: str,
    args: Config,
    model_dir: str,
    device: str,
    parent_pid: int,
    last_words: Connection,
) -> None:
    """Entry point of a spawned rank. It ends with rank 0's process: a SIGKILLed trainer runs no
    cleanup, and a rank waiting in a collective would otherwise hold its device for the
    collective timeout (30 min).

    Its failure is one line, never a traceback (gloo's, when rank 0 went away): the cause goes
    to rank 0 through `last_words`, and rank 0's error names this rank with it; with rank 0
    gone, this rank says so itself. VIME_DEBUG=1 prints the traceback too."""
    gone = f"trainer rank {rank} stops: rank 0 (pid {parent_pid}) is gone"
    exit_with_parent(parent_pid, gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops this rank with "close"
    # tqdm's default lock is a multiprocessing semaphore; a rank ended by a signal (close() does
    # that to ranks left inside a collective) never releases it, and multiprocessing's resource
    # tracker then warns of a leak after the run's last line. This rank prints no bars of its own.
    tqdm.set_lock(threading.RLock())
    try:
        _init(rank, world, init_method, device, rank)
        _serve(args, model_dir, _rank_device(device, rank))
    except Exception as e:
        if os.environ.get("VIME_DEBUG"):
            traceback.print_exc()
        try:
            last_words.send(_cause(e))
        except OSError:  # rank 0's end closed the pipe: nobody else will say why this rank stops
            leave(gone)
        # a collective fails as soon as rank 0's socket closes, maybe before its pipe does: if it
        # is exiting, the parent watch says so within this wait
        time.sleep(2 * PARENT_POLL_S)
        leave()


def _serve(args: Config, model_dir: str | Path, device: str) -> None:
    """Run rank 0's calls on this rank's Actor until it says close."""
    torch.manual_seed(args.trainer.seed)
    cpu_group = _cpu_group()
    actor = Actor(args, model_dir, device, fsdp=True, cpu_group=cpu_group)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=cpu_group)
        name, call_args, call_kwargs = box[0]
        if name == "close":
            break
        result = getattr(actor, name)(*call_args, **call_kwargs)
        if name in ("named_weights", "adapter_weights"):
            for _ in result:  # take part in every gather; only rank 0 keeps the tensors
                pass
    dist.destroy_process_group()

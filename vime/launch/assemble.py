"""`assemble(cfg) -> RunContext`: one run's parts, built in one order for `vime train`,
`vime train-async` and `vime eval`.

1. Every input checked before anything starts or is written (`vime/preflight.py`); the values
   only the inputs tell (the model's directory, --num-epoch's rollouts, the launcher auto picks)
   make the run's config, which is then frozen and, for a training run, written to config.yaml.
2. The trainer, and the engines beside it (`_trainer_and_engines`): engines that share its GPU
   size their KV cache once it holds its memory. Under torchrun the trainer comes first: ranks
   other than 0 serve rank 0 from inside `launch_actor` and never return, so they start no
   engines.
3. The engines, placed by the run's launcher (`vime/launch/launcher.py`), their clients, and the
   rollout runtime over them; a training run's plug-in services (its dialect's: slime's router,
   vime/dialect.py) and its weight pusher, whose weight group forms now, not in step 1. `vime eval` gives engines it did not
   start the weights of --hf-checkpoint.
4. The `args` plug-ins and rollout functions are handed: a frozen copy of the config and these
   live objects, read-only (`vime.plugin_args.PluginArgs`); the custom reward gets it too.

Whatever fails on the way closes what was built before it.
"""

from __future__ import annotations

import copy
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml

from vime.backends import BACKENDS
from vime.backends.client import EngineClient
from vime.backends.placement import TRAINER_READY, Placement, fresh_path, trainer_device
from vime.config import Config, ConfigError, OutputConfig, RolloutConfig
from vime.dialect import dialect_of
from vime.eval_sets import grading_line
from vime.launch.context import RunContext
from vime.launch.launcher import launcher_for
from vime.launch.mps import start as start_mps
from vime.metrics import parse_rows, setup_logging
from vime.plugin_args import PluginArgs
from vime.preflight import check_eval_inputs, check_inputs
from vime.rollout import process as rollout_process
from vime.rollout.runtime import HealthCheck, RolloutRuntime
from vime.startup import StartupClock
from vime.trainer.actor import Actor
from vime.trainer.distributed import DistributedActor, launch_actor
from vime.transport.push import WeightPusher

log = logging.getLogger("vime")


def assemble(cfg: Config, evaluation: bool = False) -> RunContext:
    """A training run's parts (`evaluation`: `vime eval`'s, engines and runtime only), its
    config frozen. The caller closes the context."""
    clock = StartupClock()
    # before anything of this process touches CUDA: a process is an MPS client from its first cuInit
    mps = None if evaluation else start_mps(cfg.placement, cfg.output.run_dir)
    try:
        with clock.phase("checks"):
            ctx = _checked(cfg, clock) if not evaluation else _checked_for_eval(cfg)
    except BaseException:
        if mps is not None:
            mps.close()
        raise
    ctx.mps = mps
    ctx.startup = clock
    try:
        if evaluation or ctx.cfg.rollout.debug_rollout_only:
            (ctx.run_dir / TRAINER_READY).touch()  # no trainer: engines size their KV cache at once
            with clock.phase("engines"):  # started (or reached) and ready
                _engines(ctx, relaunch=not evaluation)
        else:
            _trainer_and_engines(ctx, clock)
        if evaluation:
            if not ctx.placement.engines:  # engines given by URL: they evaluate --hf-checkpoint, not what they hold
                _push_checkpoint(ctx)
        else:
            with clock.phase("weight group"):
                _services_and_pusher(ctx)
            _rollout_process(ctx)
        # over a frozen copy: not even a write into the view's own config reaches the run's
        ctx.args = PluginArgs(copy.copy(ctx.cfg).freeze(), ctx.runtime, ctx.services)
        if ctx.rewards is not None:  # a custom reward gets the same view as every other plug-in
            ctx.rewards.args = ctx.args
    except BaseException:
        ctx.close()  # never leave engine or trainer processes behind
        raise
    return ctx


def _checked(cfg: Config, clock: StartupClock) -> RunContext:
    """A training run's inputs checked, its directory, log and config.yaml written. What belongs
    to the run as a whole (its mode and correction, config.yaml) is read off the config; the rest
    from the component that owns it."""
    out = cfg.output
    if _holds_a_run(out.run_dir) and not out.load:
        raise ConfigError(
            f"run directory {out.run_dir} already holds a run: pick another --run-name (or resume it with --load)"
        )
    if out.load and (out.run_dir / "metrics.jsonl").exists():
        # a resume rewrites its metrics (metrics.py): one it cannot read is refused before the engines start
        parse_rows(out.run_dir / "metrics.jsonl", warn=False)  # the logger warns of a torn last row
    inputs = check_inputs(cfg)  # every input, before anything starts or is written
    clock.parts["checks"] = inputs.seconds
    run_dir = inputs.cfg.output.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir / "log.txt", quiet=out.quiet)
    for note in inputs.notes:
        log.warning("%s", note)
    log.info("mode %s; %s", cfg.mode, cfg.correction_summary())
    if cfg.eval.eval_interval is not None and (grading := grading_line(cfg)):
        log.info("%s", grading)
    launcher = launcher_for(inputs.cfg.placement)
    cfg = inputs.cfg.derived(launcher=launcher.name).freeze()
    _log_debug_modes(cfg.rollout, cfg.output)
    # a resumed run keeps the config of the run it resumes (config.1.yaml, ...: one per resume)
    (fresh_path(run_dir / "config.yaml") if cfg.output.load else run_dir / "config.yaml").write_text(
        yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    )
    torch.manual_seed(cfg.trainer.seed)
    return RunContext(
        cfg,
        run_dir,
        inputs.tokenizer,
        BACKENDS[cfg.placement.rollout_backend],
        launcher,
        data_source=inputs.data_source,
        rewards=inputs.rewards,
        rollout_fn=inputs.rollout_fn,
        custom_advantages=inputs.custom_advantages,
    )


def _checked_for_eval(cfg: Config) -> RunContext:
    """`vime eval`'s model and prompts checked before an engine starts; its output directory."""
    cfg, tokenizer = check_eval_inputs(cfg)
    out = cfg.output
    run_dir = out.run_dir if out.run_name else Path(out.runs_dir) / "eval"
    run_dir.mkdir(parents=True, exist_ok=True)
    launcher = launcher_for(cfg.placement)
    cfg = cfg.derived(launcher=launcher.name).freeze()
    return RunContext(cfg, run_dir, tokenizer, BACKENDS[cfg.placement.rollout_backend], launcher)


def _trainer_and_engines(ctx: RunContext, clock: StartupClock) -> None:
    """The trainer, and the engines beside it when their backend allows (`starts_beside_trainer`),
    the trainer is one GPU rank (or CPU) and this process is the only driver (under torchrun every
    rank runs this, and ranks other than 0 never return from `launch_actor`). An engine on the
    trainer's GPU loads its weights meanwhile and sizes its KV cache once TRAINER_READY exists,
    when the trainer holds its memory (its compile goes on behind: vime/trainer/warm_up.py)."""
    gate = ctx.run_dir / TRAINER_READY
    gate.unlink(missing_ok=True)  # a resumed run's directory holds the last start's
    # one rank only: rank 0's build may end before the other ranks hold their memory
    one_rank = ctx.cfg.placement.actor_num_gpus_per_node * ctx.cfg.placement.actor_num_nodes == 1
    beside = (
        ctx.backend.starts_beside_trainer and ctx.launcher.name == "local" and "RANK" not in os.environ and one_rank
    )
    if not beside:
        with clock.phase("trainer"):
            ctx.actor = _launch_actor(ctx)
        gate.touch()
        with clock.phase("engines"):
            _engines(ctx, relaunch=True)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="vime-engines") as pool:
        engines = pool.submit(_engines, ctx, True)
        try:
            with clock.phase("trainer"):  # the engines start meanwhile
                ctx.actor = _launch_actor(ctx)
        finally:
            # a trainer that failed lets the engines finish starting, so the run's close ends them
            gate.touch()
        with clock.phase("engines"):  # what is left of their start
            engines.result()


def _launch_actor(ctx: RunContext) -> Actor | DistributedActor:
    """The model loaded, sharded and, with --compile, its compile started."""
    return launch_actor(
        ctx.cfg,
        ctx.cfg.rollout.model_dir,
        trainer_device(ctx.cfg.placement),
        ctx.tokenizer,
        ctx.run_dir,
        start_ranks=ctx.launcher.rank_starter(),
    )


def _log_debug_modes(ro: RolloutConfig, out: OutputConfig) -> None:
    if ro.debug_train_only and ro.load_debug_rollout_data is None:  # the SFT rollout function
        log.info("SFT: no engine; training on the conversations of %s, nothing pushed", ro.prompt_data)
    elif ro.debug_train_only:
        log.info(
            "--debug-train-only: no engine; training on the rollouts saved at %s, nothing pushed or evaluated",
            ro.load_debug_rollout_data,
        )
        if out.save:
            log.warning(
                "--debug-train-only: the checkpoints keep the prompt data's starting position (the saved "
                "rollouts did not come from it); a normal run resumed from them starts the data again"
            )
    if ro.debug_rollout_only:
        log.info("--debug-rollout-only: no trainer; the engines generate with the starting weights")


def _engines(ctx: RunContext, relaunch: bool) -> None:
    """The engines placed (none with --debug-train-only), their clients and the rollout runtime
    over them; `relaunch`: an engine the run launched that dies is started again (evaluation
    has no push to bring one back in step, so it goes on with the others)."""
    ro, settings, backend = ctx.cfg.rollout, ctx.cfg.placement, ctx.backend
    ctx.placement = (
        Placement(trainer_device(settings), [], [], [])
        if ro.debug_train_only
        else ctx.launcher.place_engines(backend, settings, ro.model_dir, ctx.run_dir, ro.rollout_seed)
    )
    placement = ctx.placement
    api_key = placement.api_key or settings.api_key  # the key of engines we launch is the placement's
    clients = [backend.make_client(u, api_key) for u in placement.urls]

    def start_again(i: int) -> EngineClient:
        return backend.make_client(placement.relaunch(i), api_key)

    restart = start_again if relaunch and placement.launch_one is not None else None
    ctx.runtime = RolloutRuntime(
        clients, ctx.tokenizer, placement.transports, restart, HealthCheck.of(settings), ctx.rewards
    )


def _rollout_process(ctx: RunContext) -> None:
    """--rollout-process: the rollout's per-sample work in a process of its own, started now so
    that its imports overlap the trainer's compile (vime/rollout/process.py)."""
    if not ctx.placement.urls or not rollout_process.wanted(ctx.cfg, ctx.placement.trainer_device):
        return
    api_key = ctx.placement.api_key or ctx.cfg.placement.api_key
    ctx.runtime.process = rollout_process.RolloutProcess(
        ctx.cfg, ctx.runtime, api_key, ctx.run_dir / "log.txt", setup_logging
    )
    log.info(
        "rollout: engine requests and rewards in a process of their own (--rollout-process %s), so they never take "
        "the train step's GIL",
        ctx.cfg.rollout.rollout_process,
    )


def _services_and_pusher(ctx: RunContext) -> None:
    """What the run's dialect serves its plug-ins (slime's router, for a custom generate or
    rollout function: vime/compat/), and the weight pusher of a run with a trainer and engines."""
    ro, settings, placement = ctx.cfg.rollout, ctx.cfg.placement, ctx.placement
    ctx.services = dialect_of(ctx.cfg).plugin_services(ctx.cfg, ctx.runtime)
    if ctx.actor is not None and not ro.debug_train_only:
        ctx.pusher = WeightPusher(
            list(ctx.runtime.clients),
            transport=placement.transports,
            bucket_bytes=settings.update_weight_buffer_size,
            timeout=settings.update_weights_timeout,
            master_address=placement.master_address,
            check=settings.check_weight_push,
        )
        ctx.pusher.connect(placement.trainer_device)


def _push_checkpoint(ctx: RunContext) -> None:
    """Give engines the weights of --hf-checkpoint (version 0), checked as a run's pushes are."""
    from vime.engine.core.safetensors_io import iter_safetensors

    settings, placement = ctx.cfg.placement, ctx.placement
    pusher = WeightPusher(
        list(ctx.runtime.clients),
        placement.transports,
        timeout=settings.update_weights_timeout,
        master_address=placement.master_address,
        check=settings.check_weight_push,
    )
    device = placement.trainer_device
    try:
        pusher.push(((n, t.to(device)) for n, t in iter_safetensors(ctx.cfg.rollout.model_dir)), version=0)
    finally:
        pusher.close()


def _holds_a_run(run_dir: Path) -> bool:
    """A run logged a step there (a start that failed before its first row does not count)."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0

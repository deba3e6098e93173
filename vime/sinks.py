"""Where metric rows go besides metrics.jsonl: TensorBoard (`--use-tensorboard`,
`--tb-project-name`) and Weights & Biases (`--use-wandb`, slime's flags), one row of `SINKS` each.

Apart from `vime/metrics.py` because a sink is a library vime talks to (torch's writer, W&B's
service), with its own flags and failures, while metrics.jsonl is vime's own file: a sink that
fails is closed and logged, and the jsonl still records every row. `check_sinks` checks them
before anything starts.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from vime.config import Config, ConfigError, OutputConfig
from vime.errors import VimeError

log = logging.getLogger("vime")


class Sink(Protocol):
    """Gets every row metrics.jsonl gets (non-finite numbers as None), at the row's step."""

    def log(self, step: int, row: dict[str, Any]) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoardSink:
    """Scalars of each row as TensorBoard events in `directory`. A run resumed at step N tells
    TensorBoard to drop what it logged past N before (as metrics.jsonl moves those rows aside)."""

    def __init__(self, directory: Path, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory), purge_step=start_step + 1 if start_step > 0 else None)

    def log(self, step: int, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if isinstance(v, (int, float)) and k != "step":
                self._writer.add_scalar(k, v, step)

    def close(self, failed: bool) -> None:
        self._writer.close()


def tensorboard_dir(out: OutputConfig) -> Path:
    """`<run dir>/tensorboard`; with --tb-project-name P, where slime writes them:
    `$TENSORBOARD_DIR` itself when set, else `tensorboard_log/P/<--tb-experiment-name or run name>`
    under the working directory, one tree for the runs of many projects."""
    if out.tb_project_name is None:
        return out.run_dir / "tensorboard"
    if os.environ.get("TENSORBOARD_DIR"):
        return Path(os.environ["TENSORBOARD_DIR"])
    return Path("tensorboard_log") / out.tb_project_name / (out.tb_experiment_name or run_name(out))


def _open_tensorboard(args: Config, start_step: int) -> Sink | None:
    # without tensorboard installed, TensorBoard is skipped unless --tb-project-name asks for it (check_sinks)
    out = args.output
    if not out.use_tensorboard or not _installed(TENSORBOARD):
        return None
    directory = tensorboard_dir(out)
    if out.tb_project_name is not None:
        log.info("TensorBoard events in %s", directory)
    return TensorBoardSink(directory, start_step)


class WandbSink:
    """Each row as one W&B history row at its step, the run's settings as the W&B config.

    The W&B run's id is --wandb-run-id, else the run name: a run resumed into its run directory
    (--load) resumes its W&B run. A fresh run refuses an id W&B already holds (online; offline
    runs cannot ask), so a run name used twice never mixes two runs' rows. W&B keeps a step's
    first row only: steps a resumed run trains again (metrics.superseded.jsonl) keep the values
    logged first. It reads the output component's settings (`args.output`); `args` whole is the W&B
    config."""

    def __init__(self, args: Config, start_step: int) -> None:
        import wandb

        out = args.output
        run_id = out.wandb_run_id or wandb_run_id(run_name(out))
        directory = Path(out.wandb_dir) if out.wandb_dir else out.run_dir
        directory.mkdir(parents=True, exist_ok=True)
        settings = {"api_key": out.wandb_key, "base_url": out.wandb_host, "quiet": out.quiet or None}
        try:
            with _secrets_out_of_argv():
                self.run = wandb.init(
                    project=out.wandb_project or "vime",
                    entity=out.wandb_team,
                    group=out.wandb_group,
                    name=run_name(out),
                    id=run_id,
                    resume="allow" if start_step > 0 or out.wandb_run_id else "never",
                    mode=out.wandb_mode,  # None: $WANDB_MODE, else online
                    dir=str(directory),
                    settings=wandb.Settings(**{k: v for k, v in settings.items() if v is not None}),
                )
        except wandb.errors.Error as e:
            raise VimeError(
                f"--use-wandb: W&B did not start run {run_id!r}: {first_line(e)} (--wandb-run-id {run_id} continues "
                "a W&B run of that id; --wandb-mode offline logs without a server)"
            ) from None
        # after init, not through it: a resumed W&B run keeps its config unless told a value may change
        self.run.config.update(args.to_dict(), allow_val_change=True)
        if start_step > 0 and self.run.starting_step > start_step + 1:
            log.warning(
                "W&B run %s already holds steps up to %d: this run trains steps %d-%d again, which W&B keeps as first logged "
                "(metrics.jsonl has the new rows, metrics.superseded.jsonl the old)",
                run_id,
                self.run.starting_step - 1,
                start_step + 1,
                self.run.starting_step - 1,
            )
        if self.run.disabled:
            log.info("W&B run %s: disabled (--wandb-mode or $WANDB_MODE), nothing is logged", run_id)
        else:
            log.info("W&B run %s: %s", run_id, directory / "wandb" if self.run.offline else self.run.url)

    def log(self, step: int, row: dict[str, Any]) -> None:
        # commit: the row is W&B's to write now; a crash then loses no step it was given
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=step, commit=True)

    def close(self, failed: bool) -> None:
        try:
            self.run.finish(exit_code=1 if failed else 0)
        except Exception:
            # W&B's service process is gone (`ray job stop` signals every process of a job, W&B's
            # too): without this its exit hook would report the same failure again, as a traceback
            import wandb

            try:
                wandb.teardown()
            except Exception:
                pass
            raise


SECRET_FLAGS = ("--wandb-key", "--api-key")  # the flags whose values Config.to_dict shows as <set>


@contextmanager
def _secrets_out_of_argv() -> Iterator[None]:
    """W&B records the command line (sys.argv) with the run, where anyone who sees the run reads
    it: while W&B starts, the values of SECRET_FLAGS read <set> there."""
    argv = sys.argv
    hidden, secret_next = [], False
    for arg in argv:
        flag = arg.split("=", 1)[0]
        hidden.append("<set>" if secret_next else f"{flag}=<set>" if flag in SECRET_FLAGS and "=" in arg else arg)
        secret_next = arg in SECRET_FLAGS
    sys.argv = hidden
    try:
        yield
    finally:
        sys.argv = argv


def run_name(out: OutputConfig) -> str:
    return out.run_name or out.run_dir.name


def wandb_run_id(name: str) -> str:
    """The default W&B run id: the run name, with characters W&B refuses in ids as '-'."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def _open_wandb(args: Config, start_step: int) -> Sink | None:
    return WandbSink(args, start_step) if args.output.use_wandb else None


# Each sink's opener: (args, start_step) -> the open sink, or None where the flags ask for none.
# A new sink is one class, one opener and one row (and its checks in check_sinks).
SINKS: dict[str, Callable[[Config, int], Sink | None]] = {"tensorboard": _open_tensorboard, "wandb": _open_wandb}


def open_sinks(args: Config, start_step: int = 0) -> list[Sink]:
    """The sinks args asks for, opened (W&B's run started or resumed); all or none."""
    check_sinks(args.output)  # preflight's check, again: a sink that cannot start fails in one line even here
    sinks: list[Sink] = []
    try:
        for opener in SINKS.values():
            sink = opener(args, start_step)
            if sink is not None:
                sinks.append(sink)
    except BaseException:
        close_all(sinks, failed=True)
        raise
    return sinks


def close_all(sinks: Sequence[Sink], failed: bool) -> None:
    """Each closed even if an earlier one fails (a W&B finish that cannot reach its service): one
    line each, since metrics.jsonl holds every row anyway."""
    for sink in sinks:
        try:
            sink.close(failed)
        except Exception as e:
            log.warning(
                "%s did not close cleanly (%s): metrics.jsonl has every row", type(sink).__name__, first_line(e)
            )


WANDB_FLAGS = ("project", "team", "group", "run_id", "mode", "key", "host", "dir")


def check_sinks(out: OutputConfig) -> list[str]:
    """Before anything starts: a sink asked for that cannot write raises ConfigError (one line,
    with the fix); settings that do nothing come back as notes, one line each, to log as warnings.
    `out`: the output component's settings (`cfg.output`)."""
    notes = []
    given = [f"--wandb-{name.replace('_', '-')}" for name in WANDB_FLAGS if getattr(out, f"wandb_{name}") is not None]
    if out.use_wandb:
        if not _installed("wandb"):
            raise ConfigError("--use-wandb needs wandb: pip install 'vime[wandb]' (or drop --use-wandb)")
        if out.wandb_run_id is not None:
            import wandb

            try:
                wandb.Settings(run_id=out.wandb_run_id)
            except Exception as e:  # wandb's own rule, in whichever error its version raises
                raise ConfigError(f"--wandb-run-id {out.wandb_run_id!r}: W&B refuses it ({first_line(e)})") from None
    elif given:
        notes.append(f"{', '.join(given)} without --use-wandb: nothing goes to W&B (add --use-wandb)")
    if out.tb_project_name is not None:
        if not out.use_tensorboard:
            notes.append("--tb-project-name with --no-use-tensorboard: no TensorBoard events are written")
        elif not _installed(TENSORBOARD):
            raise ConfigError(
                "--tb-project-name needs tensorboard: pip install tensorboard (or drop --tb-project-name)"
            )
    return notes


TENSORBOARD = "torch.utils.tensorboard"  # torch's writer: it needs the tensorboard package


def _installed(package: str) -> bool:
    """Whether `package` imports: a broken install counts as missing, and says so at start."""
    try:
        __import__(package)
    except ImportError:
        return False
    return True


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

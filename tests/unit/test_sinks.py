"""Where metric rows go besides metrics.jsonl: TensorBoard and Weights & Biases (slime's flags).

W&B runs for real here, offline: what it was given is read back from the run's own transaction
log (`<dir>/wandb/offline-run-*/run-<id>.wandb`, the file `wandb sync` uploads), not taken on
trust from the fact that a directory appeared.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import struct
import sys
import time
import types
from pathlib import Path

import pytest
from conftest import run_cli

from vime.config import ConfigError, parse_args
from vime.errors import VimeError
from vime.metrics import MetricsLogger
from vime.sinks import check_sinks, tensorboard_dir

pytest.importorskip("wandb")  # in the test extra; `pip install -e .` alone has no wandb


@pytest.fixture(autouse=True)
def _no_wandb_error_reports(monkeypatch):
    """W&B's service reports its own errors to W&B by default: not from these tests."""
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")


def config(tmp_path: Path, *flags: str):
    argv = ["--hf-checkpoint", "tiny", "--prompt-data", "p.jsonl", "--num-rollout", "4"]
    return parse_args([*argv, "--runs-dir", str(tmp_path), "--run-name", "r", "--quiet", *flags], entry="sync")


# ---- reading back what W&B wrote offline ----


def wandb_records(path: Path):
    """The records of a W&B transaction log: a ':W&B' header, then LevelDB-log chunks (4-byte
    checksum, 2-byte length, 1-byte type) in 32 KiB blocks, each record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record the service is still writing: read up to it
            return
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE.../LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def read_wandb_run(wandb_dir: Path) -> list[dict]:
    """Each offline run in `wandb_dir`, oldest first: its run record, config, history rows and exit
    code. W&B's service can write a run's last records a moment after `finish()` returned (seen:
    the exit record missing in ~1 of 25 reads), so a run without its exit record is read again
    for up to 10 s."""
    deadline = time.monotonic() + 10
    runs = _read_wandb_runs(wandb_dir)
    while any(run["exit_code"] is None for run in runs) and time.monotonic() < deadline:
        time.sleep(0.1)
        runs = _read_wandb_runs(wandb_dir)
    return runs


def _read_wandb_runs(wandb_dir: Path) -> list[dict]:
    """Each run's records so far; a run whose file ends in a half-written record (seen once in CI:
    its chunk's length written, its bytes not yet) reads as unfinished, so the caller reads again."""
    from google.protobuf.message import DecodeError

    runs = []
    for run_dir in sorted(wandb_dir.glob("offline-run-*")):
        (log_file,) = run_dir.glob("run-*.wandb")
        try:
            runs.append(_read_one_run(log_file))
        except DecodeError:
            runs.append({"history": [], "config": {}, "exit_code": None})
    return runs


def _read_one_run(log_file: Path) -> dict:
    run = {"history": [], "config": {}, "exit_code": None}
    for r in wandb_records(log_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run.update(id=r.run.run_id, project=r.run.project, group=r.run.run_group, name=r.run.display_name)
            run["config"].update(_items(r.run.config.update))
        elif kind == "config":
            run["config"].update(_items(r.config.update))
        elif kind == "history":
            run["history"].append(_items(r.history.item))
        elif kind == "exit":
            run["exit_code"] = r.exit.exit_code
    return run


def _items(items) -> dict:
    """W&B's key/value items (a key is `key`, or the parts of `nested_key`), values decoded."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def rows_of(history: list[dict]) -> list[dict]:
    """W&B history rows as metrics.jsonl rows: `_step` as step, W&B's own keys dropped."""
    return [{"step": h["_step"], **{k: v for k, v in h.items() if not k.startswith("_")}} for h in history]


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Each tag's (step, value) events, as TensorBoard loads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ---- a real run ----


@pytest.mark.slow
def test_a_run_logs_every_row_to_wandb_offline_and_tensorboard_by_project(tmp_path, monkeypatch):
    """train.py with slime's W&B and TensorBoard flags: every metrics.jsonl row (eval at step 0,
    two training steps, eval at 2) is a W&B history row at its step with the same values, the
    config is the run's, the run finishes with exit code 0; TensorBoard's events are under
    $TENSORBOARD_DIR (slime's layout), not in the run directory."""
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = run_cli(
        "train.py",
        *("--config", "examples/tiny.yaml", "--num-rollout", "2", "--eval-interval", "2", "--eval-limit", "4"),
        *("--runs-dir", str(tmp_path), "--run-name", "w"),
        *("--use-wandb", "--wandb-mode", "offline", "--wandb-project", "proj", "--wandb-group", "grp"),
        *("--wandb-key", "k" * 40, "--tb-project-name", "tbp"),
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[0] and "train/loss" in rows[2]

    (run,) = read_wandb_run(tmp_path / "w" / "wandb")
    assert (run["id"], run["name"], run["project"], run["group"]) == ("w", "w", "proj", "grp")
    assert rows_of(run["history"]) == rows
    assert run["config"]["rollout_batch_size"] == 4 and run["config"]["tb_project_name"] == "tbp"
    assert run["config"]["wandb_key"] == "<set>"  # the key itself is never logged
    written = [f for f in (tmp_path / "w").rglob("*") if f.is_file()]
    assert not [f for f in written if b"k" * 40 in f.read_bytes()]  # not in W&B's files or logs either
    assert run["exit_code"] == 0

    events = tmp_path / "tb"
    assert list(events.glob("events.out.tfevents.*")) and not (tmp_path / "w" / "tensorboard").exists()
    scalars = {tag: dict(events) for tag, events in tensorboard_scalars(events).items()}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                assert math.isclose(scalars[key][row["step"]], value, rel_tol=1e-6, abs_tol=1e-6), key


# ---- the W&B run's life: resume, failure, no server ----


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """A run resumed from step 2 (what --load does) logs to the W&B run of the same id, its steps
    going on from 3; --wandb-run-id names the W&B run instead of the run name."""
    args = config(tmp_path, "--use-wandb", "--wandb-mode", "offline")
    first = MetricsLogger.for_run(args, 4)
    for step in (1, 2):
        first.log(step, {"rollout/reward_mean": step / 10})
    first.close()
    # W&B names an offline run's directory by the second it starts in: a resume within the same
    # second (only a test is that quick) would write into the first one's
    time.sleep(1.1)
    again = MetricsLogger.for_run(args, 4, start_step=2)
    again.log(3, {"rollout/reward_mean": 0.3, "train/loss": float("nan")})
    again.close()
    runs = read_wandb_run(tmp_path / "r" / "wandb")
    assert [run["id"] for run in runs] == ["r", "r"]
    assert [rows_of(run["history"]) for run in runs] == [
        [{"step": 1, "rollout/reward_mean": 0.1}, {"step": 2, "rollout/reward_mean": 0.2}],
        [{"step": 3, "rollout/reward_mean": 0.3, "train/loss": None}],  # as metrics.jsonl writes NaN
    ]
    named = config(tmp_path, "--use-wandb", "--wandb-mode", "offline", "--wandb-run-id", "abc-1", "--run-name", "n")
    MetricsLogger.for_run(named, 4).close()
    assert [run["id"] for run in read_wandb_run(tmp_path / "n" / "wandb")] == ["abc-1"]


def test_a_run_that_fails_is_failed_in_wandb(tmp_path):
    """Closed while an exception unwinds the run (run.py closes it in `finally:`), the W&B run
    ends with a non-zero exit code: W&B shows it failed, not finished."""
    logger = MetricsLogger.for_run(config(tmp_path, "--use-wandb", "--wandb-mode", "offline"), 4)
    logger.log(1, {"rollout/reward_mean": 0.5})
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a step failed")
        finally:
            logger.close()
    (run,) = read_wandb_run(tmp_path / "r" / "wandb")
    assert run["exit_code"] == 1 and rows_of(run["history"]) == [{"step": 1, "rollout/reward_mean": 0.5}]


def test_a_run_outlives_its_wandb_service(tmp_path, caplog):
    """W&B's service process killed mid-run (`ray job stop` signals every process of a job, W&B's
    too): the run goes on, metrics.jsonl gets every row, W&B is dropped with one warning line,
    and closing raises nothing."""
    logger = MetricsLogger.for_run(config(tmp_path, "--use-wandb", "--wandb-mode", "offline"), 4)
    logger.log(1, {"rollout/reward_mean": 0.1})
    service = [p for p in _children(os.getpid()) if b"wandb-core" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(service) == 1
    os.kill(service[0], signal.SIGTERM)
    os.waitpid(service[0], 0)
    with caplog.at_level(logging.WARNING, logger="vime"):
        logger.log(2, {"rollout/reward_mean": 0.2})
        logger.log(3, {"rollout/reward_mean": 0.3})
        logger.close()
    assert [r["step"] for r in map(json.loads, logger.path.read_text().splitlines())] == [1, 2, 3]
    assert "WandbSink failed at step 2" in caplog.text
    assert not any(type(s).__name__ == "WandbSink" for s in logger.sinks)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                out.append(int(stat.parent.name))
        except OSError:
            continue
    return out


def test_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    """Online without an API key: one line naming W&B's reason, and no TensorBoard writer left
    open. No network: W&B refuses before it connects (and its server would be loopback)."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no `wandb login` of this machine
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    args = config(tmp_path, "--use-wandb", "--wandb-mode", "online", "--wandb-host", "http://127.0.0.1:9")
    with pytest.raises(VimeError) as e:
        MetricsLogger.for_run(args, 4)
    assert "\n" not in str(e.value) and "API key" in str(e.value) and "--wandb-mode offline" in str(e.value)


def test_a_resumed_run_warns_of_steps_wandb_already_holds(tmp_path, monkeypatch, caplog):
    """A run resumed from step 2 whose W&B run already went to step 5 (rows logged after the
    checkpoint, then a crash): W&B keeps those steps' first rows, and the log says so."""
    calls = {}

    class FakeRun:
        starting_step, offline, disabled, url = 6, False, False, "https://wandb.example/r"
        config = types.SimpleNamespace(update=lambda *a, **k: None)

        def finish(self, exit_code: int) -> None:
            pass

    def init(**kwargs):
        calls.update(kwargs)
        return FakeRun()

    fake = types.SimpleNamespace(init=init, Settings=lambda **k: k, errors=types.SimpleNamespace(Error=Exception))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with caplog.at_level(logging.WARNING, logger="vime"):
        MetricsLogger.for_run(config(tmp_path, "--use-wandb", "--no-use-tensorboard"), 8, start_step=2).close()
    assert calls["id"] == "r" and calls["resume"] == "allow"
    assert "already holds steps up to 5: this run trains steps 3-5 again" in caplog.text
    MetricsLogger.for_run(config(tmp_path / "fresh", "--use-wandb", "--no-use-tensorboard"), 8).close()
    assert calls["resume"] == "never"  # a fresh run never appends to another run's W&B history


# ---- checked before anything starts ----


def test_check_sinks(tmp_path, monkeypatch):
    """A sink asked for that cannot write is a one-line ConfigError naming the fix; flags that
    do nothing are notes."""
    assert check_sinks(config(tmp_path)) == []
    assert check_sinks(config(tmp_path, "--use-wandb", "--wandb-project", "p", "--tb-project-name", "t")) == []
    (note,) = check_sinks(config(tmp_path, "--wandb-project", "p", "--wandb-key", "k"))
    assert note == "--wandb-project, --wandb-key without --use-wandb: nothing goes to W&B (add --use-wandb)"
    (note,) = check_sinks(config(tmp_path, "--tb-project-name", "t", "--no-use-tensorboard"))
    assert note.startswith("--tb-project-name with --no-use-tensorboard")
    with pytest.raises(ConfigError, match="--wandb-run-id 'a/b': W&B refuses it"):
        check_sinks(config(tmp_path, "--use-wandb", "--wandb-run-id", "a/b"))

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"^--use-wandb needs wandb: pip install 'vime\[wandb\]'"):
        check_sinks(config(tmp_path, "--use-wandb"))
    with pytest.raises(ConfigError, match="^--tb-project-name needs tensorboard: pip install tensorboard"):
        check_sinks(config(tmp_path, "--tb-project-name", "t"))
    assert check_sinks(config(tmp_path)) == []  # TensorBoard by default is optional: jsonl is enough


def test_a_resumed_run_replaces_tensorboards_later_steps(tmp_path):
    """Resumed at step 2 after logging step 3: TensorBoard shows the new step 3, as metrics.jsonl."""
    args = config(tmp_path)
    first = MetricsLogger.for_run(args, 4)
    for step in (1, 2, 3):
        first.log(step, {"train/loss": float(step)})
    first.close()
    again = MetricsLogger.for_run(args, 4, start_step=2)
    again.log(3, {"train/loss": 30.0})
    again.close()
    assert tensorboard_scalars(tmp_path / "r" / "tensorboard")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_tensorboard_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    assert tensorboard_dir(config(tmp_path)) == tmp_path / "r" / "tensorboard"
    assert tensorboard_dir(config(tmp_path, "--tb-project-name", "p")) == Path("tensorboard_log") / "p" / "r"
    exp = config(tmp_path, "--tb-project-name", "p", "--tb-experiment-name", "e")
    assert tensorboard_dir(exp) == Path("tensorboard_log") / "p" / "e"
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert tensorboard_dir(config(tmp_path, "--tb-project-name", "p")) == tmp_path / "tb"
    assert tensorboard_dir(config(tmp_path)) == tmp_path / "r" / "tensorboard"  # the variable alone moves nothing


def test_use_wandb_without_wandb_stops_before_anything_starts(tmp_path, monkeypatch):
    """`--use-wandb` where wandb does not import: one line, exit 2, before an engine starts."""
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))  # ahead of site-packages, as a missing wandb
    out = run_cli(
        "train.py",
        *("--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(tmp_path), "--run-name", "x"),
        "--use-wandb",
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        out.stderr.strip().splitlines()[-1]
        == "error: --use-wandb needs wandb: pip install 'vime[wandb]' (or drop --use-wandb)"
    )
    assert not (tmp_path / "x" / "engine0.log").exists() and not (tmp_path / "x" / "metrics.jsonl").exists()


def test_secrets_never_reach_wandb_through_the_command_line(monkeypatch):
    """W&B records sys.argv with the run: while it starts, the keys read <set> there."""
    from vime.sinks import _secrets_out_of_argv

    argv = ["train.py", "--wandb-key", "K1", "--api-key=K2", "--wandb-project", "p", "--wandb-key=K3"]
    monkeypatch.setattr(sys, "argv", argv)
    with _secrets_out_of_argv():
        assert sys.argv == [
            "train.py",
            "--wandb-key",
            "<set>",
            "--api-key=<set>",
            "--wandb-project",
            "p",
            "--wandb-key=<set>",
        ]
    assert sys.argv is argv

"""The trainer under faults (issue 12): ranks that fall out of step or lose rank 0 end in one
line; non-finite numbers never reach the weights or a checkpoint; a full disk under metrics, the
log, a weight push or a checkpoint tears nothing; a crafted or damaged checkpoint is one line
before anything starts, none is written over, a save needs room for what it writes, and a signal
during a checkpoint write waits for it."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import PLUGINS, ROOT, alive_pids, disk_full_at, refused

from unit.engine.test_server_faults import client, engine  # noqa: F401 (fixtures: the engine a push is tried on)
from vime.config import Config
from vime.rollout.types import Sample

# ---- non-finite numbers and the weights ----------------------------------------------------


@pytest.fixture
def actor(tiny_model):
    from vime.trainer.actor import Actor

    args = Config(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0)
    return Actor(args, tiny_model)


def _batch() -> list[Sample]:
    return [
        Sample(index=i, tokens=[5, 6, 7, 8 + i, 9], response_length=2, rollout_log_probs=[-1.0, -1.0]) for i in range(4)
    ]


def _weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in actor.named_weights()}


@pytest.mark.slow
def test_trainer_ranks_that_fall_out_of_step_end_in_seconds_in_one_line(tiny_model, monkeypatch):
    """Two gloo ranks. Rank 0 interrupted inside a step (Ctrl-C or SIGTERM between two of its
    collectives) leaves rank 1 waiting in the next one, where a "close" never matches: close
    ends it instead, within seconds (it used to wait out the 30-minute collective timeout). And
    a rank killed between steps makes the next call one line naming it, not gloo's error."""
    import vime.algorithms.objective as loss_module
    from vime.trainer.distributed import TrainerRankError, launch_actor

    args = Config(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0, actor_num_procs=2)
    adv = [1.0, -1.0, 0.5, -0.5]

    two = launch_actor(args, tiny_model, "cpu")
    try:
        two.train_step(_batch(), adv)  # in step once

        def interrupted(*a, **k):
            raise KeyboardInterrupt  # here only: rank 1 computes its loss and waits for the gradients

        monkeypatch.setattr(loss_module.Objective, "policy_term", interrupted)
        with pytest.raises(KeyboardInterrupt):
            two.train_step(_batch(), adv)
    finally:
        t0 = time.monotonic()
        two.close()
        assert time.monotonic() - t0 < 15 and not any(p.is_alive() for p in two.procs)
    monkeypatch.undo()

    two = launch_actor(args, tiny_model, "cpu")
    try:
        two.train_step(_batch(), adv)
        os.kill(two.procs[0].pid, signal.SIGKILL)
        two.procs[0].join(10)
        with pytest.raises(
            TrainerRankError, match=r"^trainer rank 1 ended \(killed by signal 9\) during train_step: resume"
        ):
            two.train_step(_batch(), adv)
        with pytest.raises(TrainerRankError, match="during named_weights"):
            dict(two.named_weights())
    finally:
        t0 = time.monotonic()
        two.close()
        assert time.monotonic() - t0 < 15


RANK_FAULTS = """
import os, signal, sys
from vime.config import Config
from vime.rollout.types import Sample
from vime.trainer.distributed import TrainerRankError, launch_actor

def main(model):
    batch = [Sample(index=i, tokens=[5, 6, 7, 8 + i, 9], response_length=2, rollout_log_probs=[-1.0, -1.0]) for i in range(4)]
    common = dict(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0, actor_num_procs=2)
    two = launch_actor(Config(**common, loss_type="custom_loss", custom_loss_function_path="fault_plugins.fail_on_rank_one"), model)
    try:
        two.train_step(batch, [1.0, -1.0, 0.5, -0.5])
    except TrainerRankError as e:
        print(e, flush=True)
    two.close()
    two = launch_actor(Config(**common), model)
    two.train_step(batch, [1.0, -1.0, 0.5, -0.5])
    print(os.getpid(), two.procs[0].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 gone (OOM, a kill -9) while rank 1 waits for its next call

if __name__ == "__main__":
    main(sys.argv[1])
"""


def test_a_trainer_rank_that_fails_or_loses_rank_0_is_one_line_naming_it(tiny_model, tmp_path):
    """Two spawned gloo ranks. Rank 1 failing on its own (a loss hook that raises there) printed
    its traceback and rank 0 said only "exit code 1"; rank 0 killed left rank 1 printing gloo's
    traceback. Now rank 0's error gives rank 1's cause, and rank 1 whose rank 0 is gone says so
    in one line, and neither prints a traceback."""
    script = tmp_path / "rank_faults.py"
    script.write_text(RANK_FAULTS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT)]), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_model)], env=env, capture_output=True, text=True, timeout=300
    )  # returns once rank 1 too has closed the pipes
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    failed, pids = out.stdout.splitlines()
    rank_zero, rank_one = map(int, pids.split())
    assert failed == (
        "trainer rank 1 ended (exit code 1: PluginError: --custom-loss-function-path fault_plugins.fail_on_rank_one "
        "raised ValueError: the loss hook broke on this rank (VIME_DEBUG=1 shows its traceback)) during train_step: "
        "resume the run with --load from its last checkpoint"
    )
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"trainer rank 1 stops: rank 0 (pid {rank_zero}) is gone"
    assert not alive_pids([rank_one])


def test_a_non_finite_loss_skips_the_step_and_the_weights_stay(actor):
    before = _weights(actor)
    m = actor.train_step(_batch(), [1.0, float("nan"), -1.0, 0.0])
    assert m["train/skipped_steps"] == 1
    assert all(torch.equal(before[n], t) for n, t in actor.named_weights())
    assert not actor.optimizer_step.optimizer.state  # AdamW's moments never saw the NaN
    m = actor.train_step(_batch(), [1.0, -1.0, 1.0, -1.0])
    assert m["train/skipped_steps"] == 0 and any(not torch.equal(before[n], t) for n, t in actor.named_weights())


def test_the_fused_optimizer_skips_a_non_finite_step_without_the_host_checking_first(tiny_model):
    """With a fused AdamW (as on CUDA) the loss and the norm are checked on the device and the
    optimizer skips itself (`found_inf`), the step queued before any metric is read. A skipped
    step must leave weights and AdamW's state as they were: the clean step after it gives bit
    for bit the weights of a clean step taken first. (CPU's AdamW has the fused kernel too.)"""
    from vime.trainer.actor import Actor

    def fused_actor() -> Actor:
        a = Actor(Config(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0), tiny_model)
        a.optimizer_step.optimizer = torch.optim.AdamW(a.model.parameters(), lr=1e-2, fused=True)
        return a

    clean, poisoned = fused_actor(), fused_actor()
    start = _weights(poisoned)
    assert clean.train_step(_batch(), [1.0, -1.0, 1.0, -1.0])["train/skipped_steps"] == 0
    m = poisoned.train_step(_batch(), [1.0, float("nan"), -1.0, 0.0])
    assert m["train/skipped_steps"] == 1 and poisoned.optimizer_step.optimizer.found_inf.item() == 1.0
    assert all(torch.equal(start[n], t) for n, t in poisoned.named_weights())
    assert all(
        float(st["step"]) == 0 for st in poisoned.optimizer_step.optimizer.state.values()
    )  # rolled back on the device
    assert poisoned.train_step(_batch(), [1.0, -1.0, 1.0, -1.0])["train/skipped_steps"] == 0
    after = _weights(clean)
    assert any(not torch.equal(start[n], after[n]) for n in start)
    assert all(torch.equal(after[n], t) for n, t in poisoned.named_weights())


def test_a_full_disk_under_metrics_the_log_or_a_weight_push_is_one_line_and_tears_nothing(
    actor,
    client,  # noqa: F811 (the fixture imported above)
    tmp_path,
    capsys,
):
    """metrics.jsonl: the row that does not fit is taken back whole and the run stops in one
    line; log.txt: one warning, not a traceback per record; a push through shared memory: one
    line, and no partial weights file left to fill the disk further."""
    from vime.metrics import MetricsError, MetricsLogger, parse_rows, setup_logging
    from vime.transport.base import WeightWriteError
    from vime.transport.push import WeightPusher

    metrics = MetricsLogger(tmp_path / "run", total_steps=3, quiet=True)
    metrics.log(1, {"rollout/reward_mean": 0.5})
    path = tmp_path / "run" / "metrics.jsonl"
    size = path.stat().st_size
    with disk_full_at(size + 10), pytest.raises(MetricsError) as e:
        metrics.log(2, {"rollout/reward_mean": 0.25, "note": "x" * 100})
    assert re.fullmatch(
        r"cannot write step 2's metrics to .*metrics.jsonl \(File too large\): make room .*", str(e.value)
    )
    metrics.close()
    assert path.stat().st_size == size and [r["step"] for r in parse_rows(path)] == [1]

    setup_logging(tmp_path / "run" / "log.txt")
    try:
        logging.getLogger("vime").info("a record that does not format: %d", "x")  # its own bug: log.txt stays
        logging.getLogger("vime").info("still written")
        assert "still written" in (tmp_path / "run" / "log.txt").read_text()
        with disk_full_at((tmp_path / "run" / "log.txt").stat().st_size + 10):
            for _ in range(3):
                logging.getLogger("vime").info("a line longer than the room left " * 3)
    finally:
        setup_logging()
    err = capsys.readouterr().err.split("still written")[-1]
    assert err.count("warning: cannot write") == 1 and "log.txt (File too large)" in err and "Traceback" not in err

    shm = tmp_path / "shm"
    shm.mkdir()
    pusher = WeightPusher([client], transport="shm", tmp_dir=shm)
    with disk_full_at(64 * 1024), pytest.raises(WeightWriteError) as e:
        pusher.push(actor.named_weights(), 1)
    assert re.fullmatch(
        r"cannot write the weights for the engines to .*shm \(.*File too large.*\): make room .*", str(e.value)
    )
    assert not list(shm.iterdir())


def test_no_checkpoint_from_non_finite_weights_and_a_full_disk_keeps_the_last_one(actor, tmp_path):
    from vime.trainer.checkpoint import CheckpointError, latest_checkpoint, problem
    from vime.trainer.nonfinite import NonFiniteError

    actor.save(tmp_path / "1", {"step": 1})
    with (
        disk_full_at(64 * 1024),
        pytest.raises(CheckpointError, match="writing checkpoint .*/2 failed \\(.*File too large") as e,
    ):
        actor.save(tmp_path / "2", {"step": 2})
    assert "\n" not in str(e.value)
    with torch.no_grad():
        next(actor.model.parameters())[0] = float("inf")
    with pytest.raises(NonFiniteError, match="not writing checkpoint .*/3: 1 weight tensors hold non-finite values"):
        actor.save(tmp_path / "3", {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # no debris of the refused saves
    assert problem(tmp_path / "1") is None and latest_checkpoint(tmp_path) == tmp_path / "1"


# ---- inputs checked before anything starts -------------------------------------------------


def resumable_extra(step: int, policy_version: int) -> dict:
    """The extra state of a checkpoint a run resumes: its step, the optimizer steps taken (the
    actor's count, which the state holds too) and the data source's position."""
    data = {"epoch": 0, "offset": 4 * step, "next_index": 16 * step, "next_group": 4 * step, "requeued": []}
    return {
        "step": step,
        "policy_version": policy_version,
        "weight_pushes": step,
        "data_source": data,
        "wall_clock": 1.0,
    }


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under `d` with its size and mtime: what "nothing written there" compares."""
    return {str(f.relative_to(d)): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(d.rglob("*"))}


def _crafted(ckpt: Path, state=None, weights=None) -> Path:
    """A copy of `ckpt` (a step directory) whose trainer state and model file `state` and
    `weights` rewrite (each a function of the loaded one), in a --save directory of its own."""
    from safetensors.torch import load_file, save_file

    out = ckpt.parent.parent / f"crafted{len(list(ckpt.parent.parent.glob('crafted*')))}" / ckpt.name
    shutil.copytree(ckpt, out)
    if state is not None:
        torch.save(state(torch.load(out / "trainer_state.pt", weights_only=False)), out / "trainer_state.pt")
    if weights is not None:
        save_file(weights(load_file(out / "model.safetensors")), out / "model.safetensors", metadata={"format": "pt"})
    return out.parent


def _set(tree: dict, path: tuple, value) -> dict:
    inner = tree
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return tree


def test_a_crafted_or_damaged_checkpoint_is_one_line_before_anything_starts(actor, tiny_model, tmp_path, monkeypatch):
    """Each of these failed in the trainer after the engines had started, with a raw traceback
    (KeyError, TypeError, a size mismatch inside Adam at step 1 or in load_state_dict), or was
    blamed on --global-batch-size; a regular file given as --load started a fresh run."""
    monkeypatch.chdir(ROOT)
    samples = [Sample(index=i, tokens=[5, 6, 7, 8, 9], response_length=2) for i in range(4)]
    actor.train_step(samples, [1.0, 0.0, 1.0, 0.0])  # Adam's moments exist from here
    good = actor.save(tmp_path / "ck" / "1", resumable_extra(1, actor.optimizer_step.count))
    moment = "model.layers.0.mlp.down_proj.weight"  # [64, 128] in the tiny model: transposed is another shape
    file_ = tmp_path / "a-file"
    file_.write_text("not a checkpoint")
    cases = [
        (_crafted(good, state=lambda s: [s]), r"trainer_state.pt: holds a list, where vime writes a dict of optimizer"),
        (
            _crafted(good, state=lambda s: {k: v for k, v in s.items() if k != "optimizer"}),
            r"trainer_state.pt: key 'optimizer' is missing, expected a dict",
        ),
        (
            _crafted(good, state=lambda s: _set(s, ("optimizer", "state", moment, "exp_avg"), torch.zeros(128, 64))),
            rf"optimizer.state\['{moment}'\]\['exp_avg'\] is \[128, 64\], expected a tensor of shape \[64, 128\]",
        ),
        (
            _crafted(
                good, state=lambda s: _set(s, ("optimizer", "state", "lm_head.bias"), {"exp_avg": torch.zeros(3)})
            ),
            r"optimizer names 'lm_head.bias', which is no parameter this run trains",
        ),
        (
            _crafted(good, state=lambda s: _set(s, ("optimizer", "param_groups", 0, "betas"), "x")),
            r"optimizer.param_groups holds betas='x', expected a number \(or a pair of numbers\)",
        ),
        (
            _crafted(good, state=lambda s: _set(s, ("optimizer_steps",), 7)),  # an AssertionError in the run
            r"key 'optimizer_steps' is 7, but extra\['policy_version'\] is 1: they count the same steps",
        ),
        (_crafted(good, state=lambda s: _set(s, ("extra", "step"), -3)), r"extra\['step'\] is -3, expected the step"),
        (_crafted(good, state=lambda s: _set(s, ("extra", "step"), 1.5)), r"extra\['step'\] is 1.5, expected the step"),
        (
            _crafted(good, state=lambda s: _set(s, ("rng", "python"), "seed")),
            r"rng is not the random generators' state vime writes",
        ),
        (
            _crafted(good, weights=lambda w: {**w, moment: w[moment].T.contiguous()}),
            rf"model.safetensors: tensor '{moment}' has shape \[128, 64\], the model's is \[64, 128\]",
        ),
        (file_, rf"--load {file_} is a file: give the --save directory of a vime run"),
    ]
    for load, match in cases:
        said = refused(tmp_path, "--load", str(load))
        assert re.search(match, said), (load, said)
    # the intact one gets past the check, to the refusal of a run with nothing left to train
    assert "nothing is left to train" in refused(tmp_path, "--load", str(good.parent))


def test_a_checkpoint_of_wrong_values_or_dtypes_is_one_line_before_anything_starts(
    actor, tiny_model, tmp_path, monkeypatch
):
    """Shapes right, values not: an int64 weight or moment was cast unsaid; a NaN weight, a NaN
    or negative second moment or a NaN step count made the weights NaN, the run ending at a push
    with the engine's refusal; a state key vime does not write, and param groups that lack a
    parameter (it went on with a fresh state), were taken."""
    monkeypatch.chdir(ROOT)
    samples = [Sample(index=i, tokens=[5, 6, 7, 8, 9], response_length=2) for i in range(4)]
    actor.train_step(samples, [1.0, 0.0, 1.0, 0.0])
    good = actor.save(tmp_path / "ck" / "1", resumable_extra(1, actor.optimizer_step.count))
    moment = "model.layers.0.mlp.down_proj.weight"
    entry = ("optimizer", "state", moment)
    state = r"trainer_state.pt: optimizer.state\['model.layers.0.mlp.down_proj.weight'\]"
    cases = [
        (_crafted(good, weights=lambda w: {**w, moment: w[moment].long()}), rf"tensor '{moment}' is of dtype I64"),
        (
            _crafted(good, weights=lambda w: {**w, moment: w[moment].index_fill(0, torch.tensor([0]), float("nan"))}),
            rf"model.safetensors: tensor '{moment}' holds NaN or inf values",
        ),
        (
            _crafted(good, state=lambda s: _set(s, (*entry, "exp_avg"), torch.zeros(64, 128, dtype=torch.long))),
            rf"{state}\['exp_avg'\] is of dtype torch.int64",
        ),
        (
            _crafted(good, state=lambda s: _set(s, (*entry, "exp_avg_sq"), torch.full((64, 128), float("nan")))),
            rf"{state}\['exp_avg_sq'\] holds NaN or inf values",
        ),
        (
            _crafted(good, state=lambda s: _set(s, (*entry, "exp_avg_sq"), -torch.ones(64, 128))),
            rf"{state}\['exp_avg_sq'\] holds negative values",
        ),
        (
            _crafted(good, state=lambda s: _set(s, (*entry, "step"), torch.tensor(float("nan")))),
            rf"{state}\['step'\] is tensor\(nan\), expected a number >= 0",
        ),
        (_crafted(good, state=lambda s: _set(s, ("bogus",), 1)), r"key 'bogus' is none vime writes"),
        (
            _crafted(good, state=lambda s: _set(s, ("optimizer", "param_groups", 0, "params"), [])),
            r"optimizer.param_groups lack '",
        ),
    ]
    for load, match in cases:
        said = refused(tmp_path, "--load", str(load))
        assert re.search(match, said), (load, said)


def test_no_checkpoint_is_written_over_and_load_resumes_only_what_it_names(actor, tiny_model, tmp_path, monkeypatch):
    """--save over another run's checkpoints, --load of an older step into the --save holding newer
    ones, --load of a Megatron checkpoint or an HF model: each used to start (the last two from
    the base model, as if the directory were empty) and write over what was there."""
    from vime.config import parse_args
    from vime.preflight import check_inputs

    monkeypatch.chdir(ROOT)
    ck = tmp_path / "ck"
    for step in (1, 2, 3):  # what a run writes: --load checks the step and data position
        actor.save(ck / str(step), resumable_extra(step, actor.optimizer_step.count))
    mega = tmp_path / "mega"  # slime's --save after 10 iterations
    (mega / "iter_0000010").mkdir(parents=True)
    (mega / "iter_0000010" / "__0_0.distcp").write_bytes(b"shard")
    (mega / "latest_checkpointed_iteration.txt").write_text("10")
    damaged = tmp_path / "other" / "4"
    shutil.copytree(ck / "1", damaged)
    (damaged / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut short")
    before = {d: _tree(d) for d in (ck, mega, damaged)}
    cases = [
        (
            ["--save", str(ck)],
            f"--save {ck} already holds checkpoints \\(steps 1, 2, 3\\) this run would overwrite: resume them with "
            f"--load {ck}, pick another --save, or pass --overwrite-save to replace them",
        ),
        (
            ["--load", str(ck / "1"), "--save", str(ck)],
            f"--load {ck}/1 resumes from step 1, and --save {ck} holds newer checkpoints \\(steps 2, 3\\) this run "
            f"would overwrite: resume from the newest with --load {ck},",
        ),
        (
            ["--load", str(mega), "--save", str(mega)],
            f"--load {mega} holds a Megatron/slime checkpoint \\(iter_0000010/, latest_checkpointed_iteration.txt\\), "
            "which vime cannot resume",
        ),
        (["--load", str(mega / "iter_0000010")], r"holds a Megatron/slime checkpoint \(__0_0.distcp\)"),
        (  # an HF model given as --load: its files are named, it is not taken for an empty directory
            ["--load", str(tiny_model)],
            f"--load {tiny_model} holds no vime checkpoint \\(found .*config.json, .*\\): give the --save directory",
        ),
        (
            ["--load", str(damaged)],
            f"--load {damaged} is a damaged checkpoint \\(.*\\): pass its parent {damaged.parent} to resume",
        ),
    ]
    for argv, match in cases:
        assert re.search(match, refused(tmp_path, *argv)), argv
    after = {d: _tree(d) for d in (ck, mega, damaged)}
    after[ck].pop(".vime.lock")  # the refused --save's lock, taken before its checks: no checkpoint touched
    assert after == before  # and not even a lock file in the Megatron --load/--save

    # what the flags say is done: a step directory resumes from that step, --overwrite-save replaces
    base = ["--config", "examples/tiny.yaml", "--num-rollout", "5", "--runs-dir", str(tmp_path / "runs")]
    args = parse_args([*base, "--load", str(ck / "3"), "--save", str(ck)])
    inputs = check_inputs(args)
    inputs.rewards.close()
    assert (
        args.load == str(ck / "3")
        and f"--load {ck}/3 is the checkpoint of step 3: resuming from that step" in inputs.notes
    )
    args = parse_args([*base, "--save", str(ck), "--overwrite-save"])
    inputs = check_inputs(args)
    inputs.rewards.close()
    assert (
        f"--overwrite-save: the checkpoints of steps 1, 2, 3 in --save {ck} are replaced as this run saves those steps"
        in inputs.notes
    )


def test_save_needs_room_for_float32_weights_and_the_optimizers_state_whatever_the_files_hold(tmp_path, monkeypatch):
    """A checkpoint holds float32 master weights and AdamW's two moments, 12 bytes a parameter:
    six times a bf16 model's files, where the check once asked for three times the files and let
    a 4B run start on a disk without room for its first save. Asked of the real headers of a
    float32 and a bf16 copy of one model; the free space is the disk's answer, made up."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file, save_file

    from vime.compat import parameter_count
    from vime.config import ConfigError, parse_args
    from vime.models import make_tiny_model
    from vime.preflight import _room_for_checkpoints

    f32 = make_tiny_model(tmp_path / "f32", arch="qwen3", seed=0)
    bf16 = tmp_path / "bf16"
    shutil.copytree(f32, bf16)
    weights = load_file(str(f32 / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(bf16 / "model.safetensors"))
    params = sum(v.numel() for v in weights.values())
    assert parameter_count(bf16) == parameter_count(f32) == params
    files = (bf16 / "model.safetensors").stat().st_size
    base = ["--hf-checkpoint", "m", "--prompt-data", "d", "--num-rollout", "1"]
    free = 0
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(total=1 << 40, used=0, free=free))
    for extra, need in (
        ([], 12 * params),
        (["--optimizer", "sgd"], 8 * params),
        (["--optimizer", "sgd", "--sgd-momentum", "0"], 4 * params),
        (["--lora-rank", "4"], 4 * params),
    ):
        trainer = parse_args([*base, *extra]).trainer
        for model in (f32, bf16):
            free = need - 1
            with pytest.raises(ConfigError, match="a checkpoint of this model takes about"):
                _room_for_checkpoints(tmp_path, model, trainer)
            free = need
            _room_for_checkpoints(tmp_path, model, trainer)
    # room for three times the bf16 files, which the old rule asked for, is refused now
    free = 3 * files
    with pytest.raises(ConfigError, match="a checkpoint of this model takes about"):
        _room_for_checkpoints(tmp_path, bf16, parse_args(base).trainer)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_a_checkpoint_write_waits_for_it(sig, monkeypatch):
    """Every checkpoint is written under `signals_held`: a signal there neither cuts the write
    short (it once failed a save as an I/O error, or hung it, when Ctrl-C landed inside torch's
    writer) nor is lost; the write finishes, then the signal acts as it would have, and the
    handlers are back as they were."""
    import vime.lifetime
    from vime.lifetime import Terminated, signals_held, stop_on_sigterm

    # the SIGTERM sent here is this process's: the flag it sets must not outlive the test (a
    # later test in this worker would read every error as "terminated")
    monkeypatch.setattr(vime.lifetime, "_sigterm_received", False)
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm()
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt) as raised, signals_held():
            os.kill(os.getpid(), sig)
            time.sleep(0.2)  # a system call the signal would otherwise have interrupted
            steps.append("written")
        assert raised.type is (Terminated if sig == signal.SIGTERM else KeyboardInterrupt)
        assert steps == ["written"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)

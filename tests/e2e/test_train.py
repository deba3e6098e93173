"""train.py end to end on the tiny model: metrics, checkpoints/resume, and bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import ROOT, run_cli, train_here

PERF_KEYS = [
    "perf/step_time",
    "perf/train_wait_time",
    "perf/train_time",
    "perf/update_weights_time",
    "perf/wall_clock",
    "perf/rollout_time",
    "perf/other_time",
]


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_yaml_two_rollouts_record_every_metric(tmp_path):
    """The tiny example's two steps, each with its timings, rollout and train metrics, from the
    weights the engine sampled with. How fast it runs is no test's business (timed on a loaded CI
    machine it failed at 104 s against 90): the run's own timeout bounds only a hang."""
    out = run_cli(
        "train.py",
        "--config",
        "examples/tiny.yaml",
        "--num-rollout",
        "2",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "t",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = read_rows(tmp_path / "t")
    steps = [r for r in rows if "perf/step_time" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for k in PERF_KEYS:
            assert k in r and r[k] >= 0, k
        assert r["perf/step_time"] >= r["perf/train_time"]
        for k in [
            "rollout/reward_mean",
            "rollout/response_len_mean",
            "rollout/truncated_ratio",
            "train/loss",
            "train/pg_clipfrac",
            "train/grad_norm",
            "train/train_rollout_logprob_abs_diff",
        ]:
            assert k in r, k
        assert r["rollout/staleness_max"] == 0  # sync: every token from the trainer's current policy
    # the engine's log-probs come from the same weights the trainer recomputes with
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert any(r["train/grad_norm"] > 0 for r in steps)  # the example's reward varies: the weights move
    assert (tmp_path / "t" / "config.yaml").exists() and (tmp_path / "t" / "log.txt").exists()
    # the start-up's phases, from the process's start to step 1 (vime/startup.py)
    line = next(x for x in (tmp_path / "t" / "log.txt").read_text().splitlines() if "s before step 1 (" in x)
    total = float(re.search(r"start-up ([\d.]+) s", line)[1])
    body = line.split("): ", 1)[1]

    def seconds(parts: str) -> dict[str, float]:
        return {k: float(v) for k, v in (p.rsplit(" ", 1) for p in parts.split(", "))}

    phases = seconds(re.sub(r" \([^)]*\)", "", body))  # the checks' own split, in brackets, left out
    assert list(phases) == ["imports", "checks", "trainer", "engines", "weight group", "resume and first push", "other"]
    # torch was imported. The engines phase is what their start adds after the trainer's build: 0.0
    # where the engine was serving first (a quiet machine), so its own log line, below, shows it started.
    assert phases["imports"] > 0, line
    assert abs(sum(phases.values()) - total) <= 0.05 * len(phases) + 0.05, line  # each rounded to 0.1
    checks = seconds(re.search(r"checks [\d.]+ \(([^)]*)\)", body)[1])
    assert list(checks) == ["outputs", "tokenizer", "model", "plug-ins loaded", "data", "plug-ins called"], line
    assert sum(checks.values()) <= phases["checks"] + 0.05 * len(checks) + 0.05, line  # a split of the phase
    # the engine's own start, from its process's start to serving (vime/engine/server.py)
    line = next(x for x in (tmp_path / "t" / "engine0.log").read_text().splitlines() if "start-up " in x)
    total = float(re.search(r"start-up ([\d.]+) s before serving: ", line)[1])
    phases = seconds(line.split(" s before serving: ", 1)[1])
    assert list(phases) == ["imports", "CUDA and weights", "KV cache and CUDA graphs", "other"], line
    assert phases["imports"] > 0 and abs(sum(phases.values()) - total) <= 0.05 * len(phases) + 0.05, line


@pytest.mark.slow
def test_progress_lines_on_redirected_output_and_in_log_txt(tmp_path, capfd):
    """Output that is no terminal gets one plain line per step (and the eval lines); log.txt always
    does; --quiet keeps them off stderr only. Both runs in this process (train_here), their
    stderr (captured: no terminal) read by capfd."""
    common = [
        "--config",
        "examples/tiny.yaml",
        "--num-rollout",
        "2",
        "--eval-interval",
        "2",
        "--eval-limit",
        "4",
        "--runs-dir",
        str(tmp_path),
    ]
    capfd.readouterr()
    train_here("sync", *common, "--run-name", "p")
    err = capfd.readouterr().err
    for text in (err, (tmp_path / "p" / "log.txt").read_text()):
        for step in (1, 2):
            line = next(ln for ln in text.splitlines() if f"step {step}/2 | reward " in ln)
            assert " | len " in line and " | wait " in line and " | ETA " in line, line
        assert "eval step 2: accuracy" in text and "eval step 0: accuracy" in text
    train_here("sync", *common, "--run-name", "q", "--quiet")
    err = capfd.readouterr().err
    assert "step 1/2 |" not in err and "eval step 2" not in err
    assert "step 1/2 |" in (tmp_path / "q" / "log.txt").read_text()


def test_a_colocated_run_releases_the_engine_and_pushes_into_it_resumed(tmp_path):
    """--colocate: each step the engine gives its memory back (the KV pools here; on a GPU the
    weights too) while the trainer steps, takes it back after, and the run logs the bytes. With a
    push every second step the engine samples step 2 from step 0's weights, which shows as the
    engine's log-probs drifting from the trainer's by a step's move; at step 3, after the push
    into the resumed engine, they agree again (float32 on CPU; tests/gpu/test_runs.py runs the same
    on CUDA)."""
    train_here(
        "sync", "--config", "examples/tiny.yaml", "--colocate", "--num-rollout", "3", "--lr", "0.1",
        "--update-weights-interval", "2", "--runs-dir", str(tmp_path), "--run-name", "c",
    )  # fmt: skip
    steps = [r for r in read_rows(tmp_path / "c") if "perf/step_time" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["perf/engine_released_bytes"] > 0 for r in steps)
    diff = [r["train/train_rollout_logprob_abs_diff"] for r in steps]
    assert diff[0] < 1e-4 and diff[1] > 0.05 and diff[2] < 1e-4, diff


def test_python_dash_m_vime_is_the_vime_command():
    out = run_cli("-m", "vime", "--help", timeout=60)
    assert out.returncode == 0 and "train-async" in out.stdout


@pytest.mark.slow
def test_checkpoint_and_resume(tmp_path, tiny_model, addition_data, capfd):
    """The three runs in this process (train_here, and train.py's own entry for the refused one):
    what they wrote and said, without a fresh interpreter's imports each."""
    train, test = addition_data
    # pushing every other step, so the policy version (optimizer steps) and the push count differ
    common = [
        "--hf-checkpoint",
        str(tiny_model),
        "--prompt-data",
        str(train),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "4",
        "--lr",
        "1e-3",
        "--runs-dir",
        str(tmp_path),
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "1",
        "--rm-type",
        "math_shaped",
        "--update-weights-interval",
        "2",
    ]
    train_here("sync", *common, "--num-rollout", "2", "--run-name", "a")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".vime.lock",
        "1",
        "2",
    ]  # the lock of the run that owned it, and its checkpoints
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "2")  # checkpoints are plain HF directories
    # --load given the step directory itself (not its parent) resumes from that step
    capfd.readouterr()
    train_here("sync", *common, "--num-rollout", "3", "--run-name", "b", "--load", str(tmp_path / "ckpt" / "2"))
    err = capfd.readouterr().err
    assert f"--load {tmp_path}/ckpt/2 is the checkpoint of step 2: resuming from that step" in err, err[-2000:]
    assert f"resumed from {tmp_path}/ckpt/2 at step 2" in err, err[-2000:]
    # resuming a run that is already at its last step would train nothing: refused before it starts
    last = _refused([*common, "--num-rollout", "3", "--run-name", "c", "--load", str(tmp_path / "ckpt")])
    assert "resumes after step 3, and this run ends at step 3" in last
    assert not (tmp_path / "c").exists() and sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".vime.lock",
        "1",
        "2",
        "3",
    ]
    rows = [r for r in read_rows(tmp_path / "b") if "perf/step_time" in r]
    assert [r["step"] for r in rows] == [3]  # continued after step 2, not from scratch
    # three optimizer steps; the engines hold the weights of step 2 (re-sent on resume, not
    # counted), pushed once so far
    assert (rows[0]["train/policy_version"], rows[0]["train/weight_version"], rows[0]["train/weight_pushes"]) == (
        3,
        2,
        1,
    )
    import torch

    state = torch.load(tmp_path / "ckpt" / "2" / "trainer_state.pt", weights_only=True)  # plain data only
    resumed = torch.load(tmp_path / "ckpt" / "3" / "trainer_state.pt", weights_only=True)
    assert (state["extra"]["policy_version"], state["extra"]["weight_pushes"]) == (2, 1)
    assert (resumed["extra"]["policy_version"], resumed["extra"]["weight_pushes"]) == (3, 1)
    first_rows = [r for r in read_rows(tmp_path / "a") if "perf/step_time" in r]
    assert any(r["train/grad_norm"] > 0 for r in first_rows + rows)
    # data position moved on by exactly one rollout batch from where step 2 left it
    assert resumed["extra"]["data_source"]["offset"] == state["extra"]["data_source"]["offset"] + 2


BAD_BASE = ("--hf-checkpoint", "tiny", "--num-rollout", "1")


def _bad(tmp_path, *argv):
    return _refused([*BAD_BASE, "--runs-dir", str(tmp_path), *argv])


def _refused(argv: list[str]) -> str:
    """The last stderr line of train.py's own entry (`guarded(train_main)`) on bad input, which
    must exit 2 with one `error:` line. Run in this process: a subprocess per case cost ~10 s of
    imports each; test_bad_input_missing_file runs the script itself."""
    from vime.cli import guarded, train_main

    err, sigterm = io.StringIO(), signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.redirect_stderr(err), contextlib.chdir(ROOT):
            code = guarded(lambda a: train_main(a, "sync"), argv)
    except SystemExit as e:  # argparse's exit
        code = e.code
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # guarded() installs vime's handler
    assert code == 2, err.getvalue()[-2000:]
    msg = err.getvalue().strip().splitlines()
    assert len(msg) >= 1 and msg[-1].startswith("error: "), err.getvalue()[-2000:]
    return msg[-1]


def test_bad_input_missing_file(tmp_path):
    """Through the script itself, in its own process, as a user runs it."""
    out = run_cli(
        "train.py", *BAD_BASE, "--runs-dir", str(tmp_path), "--prompt-data", str(tmp_path / "nope.jsonl"), timeout=120
    )
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "nope.jsonl" in last, out.stderr[-2000:]


def test_bad_input_missing_key(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "1+1=", "label": "2"}\n')
    assert "'input'" in _bad(tmp_path, "--prompt-data", str(f))


def test_bad_input_empty_dataset(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("")
    assert "empty" in _bad(tmp_path, "--prompt-data", str(f)).lower()


@pytest.mark.parametrize(
    "row, fragment",
    [
        ({"input": "  ", "label": "1"}, "row 1 (line 2): 'input' is empty: every row needs a prompt"),
        ({"input": "1+1=", "label": None}, "row 1 (line 2): 'label' is null, and --rm-type math grades against it"),
        ({"input": "1+1=", "label": ""}, "row 1 (line 2): 'label' is empty, and --rm-type math grades against it"),
    ],
)
def test_bad_input_empty_prompt_or_label_is_named_before_anything_starts(tmp_path, row, fragment):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"input": "2+2=", "label": "4"}) + "\n" + json.dumps(row) + "\n")
    msg = _bad(tmp_path, "--prompt-data", str(f))
    assert fragment in msg and str(f) in msg
    assert not any(tmp_path.glob("*/metrics.jsonl"))  # refused before a run directory was used


def test_bad_input_not_utf8(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"input": "1+1=", "label": "2"}\n{"input": "caf\xe9", "label": "1"}\n')
    assert f"{f}: not UTF-8 text (byte 46, line 2: invalid continuation byte)" in _bad(
        tmp_path, "--prompt-data", str(f)
    )


def test_bad_input_malformed_json_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": \n')
    assert "line 2" in _bad(tmp_path, "--prompt-data", str(f))


def test_bad_input_unknown_rm_type(tmp_path, addition_data):
    assert "nonsense" in _bad(tmp_path, "--prompt-data", str(addition_data[0]), "--rm-type", "nonsense")


def test_bad_input_engine_unreachable(tmp_path, addition_data):
    msg = _bad(tmp_path, "--prompt-data", str(addition_data[0]), "--rollout-engine-urls", "http://127.0.0.1:9")
    assert "127.0.0.1:9" in msg and "unreachable" in msg


def test_a_fresh_name_is_claimed_so_two_evals_at_once_never_share_one(tmp_path):
    """Two `vime eval` of one run name at once both picked eval.jsonl (each looked before the
    other wrote) and one result was lost; the name is now taken when it is picked."""
    from vime.backends.placement import fresh_path

    picked = [fresh_path(tmp_path / "ev" / "eval.jsonl") for _ in range(3)]  # none written yet
    assert [p.name for p in picked] == ["eval.jsonl", "eval.1.jsonl", "eval.2.jsonl"]
    assert all(p.exists() for p in picked)


@pytest.mark.slow
def test_a_second_vime_eval_keeps_the_first_ones_results(tmp_path, tiny_model, addition_data, capfd):
    """Both evals in this process (`vime eval`'s eval_main), their output read by capfd."""
    from vime.cli import eval_main

    common = ["--hf-checkpoint", str(tiny_model), "--eval-prompt-data", str(addition_data[1])]
    common += ["--eval-limit", "2", "--eval-max-response-len", "2", "--runs-dir", str(tmp_path), "--run-name", "ev"]
    assert eval_main(common) == 0
    before = (tmp_path / "ev" / "eval.jsonl").read_text()
    capfd.readouterr()
    assert eval_main(common) == 0
    assert (tmp_path / "ev" / "eval.jsonl").read_text() == before  # the first result is untouched
    assert "per-sample results: " + str(tmp_path / "ev" / "eval.1.jsonl") in capfd.readouterr().out
    assert len((tmp_path / "ev" / "eval.1.jsonl").read_text().splitlines()) == 2


def test_a_run_whose_save_or_run_directory_another_run_holds_is_refused(tmp_path, tiny_model, addition_data):
    """The lock is the one a running `train.py` takes (held here by the test process, so which
    run comes first is not left to timing); the held directories are left as they were."""
    from vime.lifetime import owned

    save = tmp_path / "ckpt"
    (save / "1").mkdir(parents=True)
    (save / "1" / "keep").write_text("a checkpoint of the first run")
    argv = ["train.py", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(addition_data[0])]
    argv += [
        "--num-rollout",
        "1",
        "--runs-dir",
        str(tmp_path),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
    ]
    with owned([(save / ".vime.lock", "the first run's save")]):
        out = run_cli(*argv, "--run-name", "second", "--save", str(save))
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1]
        == f"error: --save {save} is in use by another vime run (pid {os.getpid()}): give this run its own"
    )
    assert sorted(p.name for p in save.iterdir()) == [".vime.lock", "1"] and (save / "1" / "keep").exists()
    with owned([(tmp_path / ".first.lock", "the first run's directory")]):
        out = run_cli(*argv, "--run-name", "first")
    assert (
        out.returncode == 2
        and "error: run directory " + str(tmp_path / "first") + " is in use by another vime run" in out.stderr
    )
    assert not (tmp_path / "first" / "metrics.jsonl").exists()

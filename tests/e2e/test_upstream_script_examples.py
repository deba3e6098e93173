"""vllm-project/vime's example scripts on vime: examples/multi_agent, eval_multi_task,
train_infer_mismatch_helper and on_policy_distillation, each run through our run script (its
flags, flag for flag) on the tiny model, with plug-ins written its way
(tests/plugins/upstream_multi_agent_style.py, upstream_mis_style.py) where the example brings its
own Python files. Also the parts vime added for them: the per-call args of a custom generate, the
router's log-probs given back, the gpqa grader, its cp_utils and a custom TIS function's
total_lengths."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PLUGINS, ROOT, make_correction
from safetensors.torch import load_file
from unit.algorithms.test_opd import _reverse_kl, teacher_run  # noqa: F401 (teacher_run: a fixture)

from vime.compat.answer_log import AnswerLog
from vime.config import Config
from vime.plugin_args import PluginArgs
from vime.rollout.rewards.grading import builtin_result, choice_answer
from vime.rollout.types import Sample

# small enough for a few steps on 2 CPU cores; appended, so they win over the scripts' sizes
CPU = [
    "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
    "--rollout-max-response-len", "8", "--rollout-max-context-len", "400", "--quiet",
]  # fmt: skip
FULLY_ASYNC = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]


def _dapo_style(path: Path, n: int = 8) -> Path:
    """dapo-math-17k's layout as vllm-project/vime's scripts read it: `prompt` chat messages, `label`."""
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i + 1}=?"}], "label": str(2 * i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _upstream_dir(root: Path, name: str, files: dict[str, str]) -> Path:
    """A stand-in for vllm-project/vime's examples/<name>/ (SEED_EXAMPLE_DIR): its module names, our code."""
    d = root / "upstream" / "examples" / name
    d.mkdir(parents=True)
    for file, text in files.items():
        (d / file).write_text(text)
    return d


def _run_script(script: str, tmp_path: Path, env: dict[str, str], *extra: str, timeout: int = 400):
    """examples/<script> as a user runs it (bash, paths from the environment), on the tiny shape."""
    full_env = {
        **os.environ,
        "MODEL_SHAPE": "tiny-qwen3",
        "GPUS": "1",
        "PYTHON": sys.executable,
        "CKPT_DIR": str(tmp_path / "ckpt"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(PLUGINS), os.environ.get("PYTHONPATH", "")]),
        **env,
    }
    args = ["bash", str(ROOT / "examples" / script), *CPU, "--runs-dir", str(tmp_path), "--run-name", "r", *extra]
    r = subprocess.run(args, env=full_env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]


def _fully_async(script: str, tmp_path: Path) -> str:
    """A copy of an example script that runs its flags through train_async.py with the
    fully-async rollout function (not colocated: the async modes give the engine its own device)."""
    text = (ROOT / "examples" / script).read_text()
    for old, new in (
        ('"${VIME_ROOT}/train.py"', '"${VIME_ROOT}/train_async.py"'),
        ("   --colocate \\\n", f"   {' '.join(FULLY_ASYNC)} --rollout-num-gpus 1 \\\n"),
        ('VIME_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"', f'VIME_ROOT="{ROOT}"'),
    ):
        assert old in text, old
        text = text.replace(old, new)
    out = tmp_path / "fully_async.sh"
    out.write_text(text)
    return str(out)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the parts, without a run


def test_a_generate_call_writes_its_own_args_and_the_run_keeps_its_settings():
    args = PluginArgs(Config(rollout_batch_size=4).freeze(), runtime=None)
    mine, other = args.for_call(), args.for_call()
    mine.rollout_batch_size = 2  # multi_agent sets the run's settings on args, per call
    mine.tokenizer = "tok"
    assert mine.rollout_batch_size == 2 and other.rollout_batch_size == 4 and args.rollout_batch_size == 4
    assert not hasattr(other, "tokenizer")
    copied = copy.deepcopy(mine)  # run_agent_system's copy keeps what the call set
    assert copied.tokenizer == "tok" and copied.rollout_batch_size == 2 and copied.runtime is None
    with pytest.raises(AttributeError, match="read-only"):
        args.rollout_batch_size = 2  # outside a call, a setting stays read-only


def test_the_router_gives_back_the_log_probs_a_plugin_dropped():
    log = AnswerLog(max_tokens=8)
    log.record([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [7, 7, 7])
    mine = Sample(index=0, tokens=[1, 2, 3, 4, 5], response_length=3)
    built_elsewhere = Sample(index=1, tokens=[9, 3, 4, 5], response_length=3)
    assert not log.restore(built_elsewhere) and built_elsewhere.rollout_log_probs is None
    assert log.restore(mine) and mine.rollout_log_probs == [-0.1, -0.2, -0.3] and mine.weight_versions == [7] * 3
    assert not log.restore(Sample(index=2, tokens=[1, 2, 3, 4, 5], response_length=3))  # claimed once
    for i in range(4):  # past max_tokens the oldest answers go
        log.record([i], [i, i, i], [0.0] * 3, [])
    assert not log.restore(Sample(index=3, tokens=[0, 0, 0, 0], response_length=3))
    assert log.restore(Sample(index=4, tokens=[3, 3, 3, 3], response_length=3))


def test_gpqa_grades_the_option_letter_a_response_picks():
    assert choice_answer("<think>A or B?</think> The answer is (C).") == "C"
    assert choice_answer("I think D is correct") == "D"
    assert choice_answer("no letter here") is None
    # the answer cue over a later mention, markdown and sentence words around it, a boxed letter first
    assert choice_answer("The answer is **C**. I hope this helps.") == "C"
    assert choice_answer("Answer: B. Option C is wrong because it overcounts.") == "B"
    assert choice_answer("Between A and C, \\boxed{A}. Answer: C") == "A"
    assert choice_answer("I like it") is None
    assert builtin_result("gpqa", "Answer: B", "B")["acc"] == 1.0
    assert builtin_result("gpqa", "Answer: B", "1")["acc"] == 1.0  # a 0-based index, as slime reads one
    assert builtin_result("gpqa", "Answer: B", "A")["acc"] == 0.0


def test_the_upstream_cp_utils_hand_back_whole_responses_and_tis_gets_total_lengths():
    from conftest import loss_inputs, objective

    from vime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    x = torch.arange(3.0)
    assert all_gather_with_cp(x, 10, 3) is x and slice_log_prob_with_cp(x, 10, 3) is x
    with pytest.raises(ValueError, match="2 values for a response of 3 tokens"):
        all_gather_with_cp(x[:2], 10, 3)
    seen = {}

    def hook(*, pg_loss, total_lengths, response_lengths, **kw):
        seen.update(total=total_lengths, response=response_lengths)
        return pg_loss, None, {}

    zeros = torch.zeros(3)
    objective(0.2, correction=make_correction(custom=hook)).policy_term(
        zeros,
        zeros,
        loss_inputs(
            torch.ones(3), torch.ones(3), zeros, torch.tensor([0, 0, 1]), prompt_lens=torch.tensor([5.0, 5.0, 9.0])
        ),
    )
    assert seen == {"total": [7, 10], "response": [2, 1]}
    assert all(type(n) is int for n in seen["total"])  # lengths, as slime hands them (a float does not slice)


def test_eval_sets_vime_cannot_grade_are_refused_at_start_up(tmp_path, tiny_model):
    from conftest import run_cli

    data = _dapo_style(tmp_path / "d.jsonl")
    cfg = tmp_path / "multi_task.yaml"
    cfg.write_text(f"eval:\n  datasets:\n    - name: ifbench\n      path: {data}\n      rm_type: ifbench\n")
    r = run_cli("train.py", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(data), "--input-key", "prompt", "--apply-chat-template",
                "--eval-config", str(cfg), "--num-rollout", "1", "--runs-dir", str(tmp_path), timeout=60)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "set ifbench: rm_type 'ifbench' (IFBench's instruction checkers" in r.stderr
    cfg.write_text(f"eval:\n  datasets:\n    - name: gpqa\n      path: {data}\n      rm_type: gpqa\n")
    r = run_cli("train.py", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(data), "--input-key", "prompt", "--apply-chat-template",
                "--eval-config", str(cfg), "--num-rollout", "1", "--runs-dir", str(tmp_path), timeout=60)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr  # '11' names no option of a multiple-choice set
    assert "row 5: label '11' is not an option letter (A-J) or a 0-based option index" in r.stderr


# ---------------------------------------------------------------- the run scripts


def _multi_agent_env(tmp_path: Path, tiny_model: Path) -> dict[str, str]:
    upstream = _upstream_dir(
        tmp_path,
        "multi_agent",
        {
            "rollout_with_multi_agents.py": "from upstream_multi_agent_style import generate_with_agents as generate_with_multi_agents\n"
        },
    )
    return {
        "SEED_EXAMPLE_DIR": str(upstream),
        "MODEL_DIR": str(tiny_model),
        "DATA_PATH": str(_dapo_style(tmp_path / "d.jsonl")),
    }


def _check_team_trained(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["rollout/num_samples"] == 2 * 2 * 3  # each prompt's 2 samples came back as 3 agents
        assert r["rollout/reward_errors"] == 0
    assert any(r["train/grad_norm"] > 0 for r in rows)


def test_multi_agent_script_trains_every_agents_sample(tmp_path, tiny_model):
    """Sync, colocated, as vllm-project/vime runs it: the generate writes on its args, drops the router's
    log-probs and returns three samples per call; each is trained, its reward the one it set."""
    rows = _run_script("multi_agent/run-qwen3-4B-multi-agent.sh", tmp_path, _multi_agent_env(tmp_path, tiny_model),
                       "--num-rollout", "1", "--lr", "1e-2")  # fmt: skip
    _check_team_trained(rows, 1)
    trained = load_file(next((tmp_path / "ckpt").glob("*/model.safetensors")))
    start = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start)


@pytest.mark.slow
def test_multi_agent_fully_async_corrects_with_the_log_probs_given_back(tmp_path, tiny_model):
    """Fully-async: its default correction needs each token's rollout log-prob, which the plug-in
    dropped; the router's record gives them back, and the versions with them (staleness)."""
    script = _fully_async("multi_agent/run-qwen3-4B-multi-agent.sh", tmp_path)
    rows = _run_script(script, tmp_path, _multi_agent_env(tmp_path, tiny_model), "--num-rollout", "3", "--lr", "1e-2")
    _check_team_trained(rows, 3)
    assert all("train/tis" in r for r in rows) and rows[-1]["rollout/staleness_max"] >= 1


@pytest.mark.slow
def test_eval_multi_task_script_logs_each_set(tmp_path, tiny_model):
    """--eval-config with a math set and a multiple-choice one (gpqa): each set's metrics under
    eval/<name>/, before the first step and at the end."""
    data = _dapo_style(tmp_path / "d.jsonl")
    gpqa = tmp_path / "gpqa.jsonl"
    gpqa.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}? A) x B) y"}], "label": "AB"[i % 2]}) + "\n"
                            for i in range(4)))  # fmt: skip
    cfg = tmp_path / "multi_task.yaml"
    cfg.write_text(
        "eval:\n  defaults:\n    n_samples_per_eval_prompt: 2\n    max_response_len: 4\n    top_p: 0.7\n"
        f"  datasets:\n    - name: aime\n      path: {data}\n      rm_type: deepscaler\n"
        f"    - name: gpqa\n      path: {gpqa}\n      rm_type: gpqa\n"
    )
    env = {"MODEL_DIR": str(tiny_model), "DATA_PATH": str(data), "EVAL_CONFIG": str(cfg)}
    rows = _run_script("eval_multi_task/run-qwen3-4B-multi-task.sh", tmp_path, env, "--num-rollout", "1",
                       "--eval-interval", "1")  # fmt: skip
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for r in evals:
        assert r["eval/aime/total"] == 8 * 2 and r["eval/gpqa/total"] == 4 * 2
        assert 0 <= r["eval/gpqa/accuracy"] <= 1 and "eval/aime/accuracy" in r


def _mismatch_env(tmp_path: Path, tiny_model: Path) -> dict[str, str]:
    upstream = _upstream_dir(
        tmp_path,
        "train_infer_mismatch_helper",
        {
            "mis.py": "from upstream_mis_style import mismatch_weights as compute_mis_weights_with_cp\n",
            "mis.yaml": "use_tis: true\ntis_upper_bound: 2.0\ntis_level: token\nrs_veto_threshold: 1.0e-4\n",
        },
    )
    data = _dapo_style(tmp_path / "d.jsonl")
    return {
        "SEED_EXAMPLE_DIR": str(upstream),
        "MODEL_DIR": str(tiny_model),
        "DATA_PATH": str(data),
        "EVAL_DATA": str(data),
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "fully-async"])
def test_mismatch_helper_script_logs_its_metrics(mode, tmp_path, tiny_model):
    """The hook's per-token metrics reach the log (train/mis_*), it saw each sequence whole with
    its prompt (mis_prompt_len: the chat-templated prompt's length, > 0), in both modes."""
    script = "train_infer_mismatch_helper/run-qwen3-4b-mis.sh"
    if mode == "fully-async":
        script = _fully_async(script, tmp_path)
    rows = _run_script(script, tmp_path, _mismatch_env(tmp_path, tiny_model), "--num-rollout", "2")
    assert len(rows) == 2
    for r in rows:
        assert r["train/mis_prompt_len"] > 5 and r["train/mis_truncate_fraction"] >= 0 and "train/mis_kl" in r


@pytest.mark.slow
def test_opd_megatron_script_brings_the_student_to_the_teacher(teacher_run, tmp_path):  # noqa: F811
    """vllm-project/vime's teacher-in-the-trainer script, the teacher a tiny model trained to answer 7777:
    the student's reverse KL to it, measured apart from the run, falls (one optimizer step per rollout), and the run logs it."""
    from vime.models import resolve_model

    student = resolve_model("tiny")
    env = {
        "MODEL_DIR": str(student),
        "TEACHER_DIR": str(teacher_run),
        "DATA_PATH": str(_dapo_style(tmp_path / "d.jsonl", 16)),
    }
    rows = _run_script("on_policy_distillation/run-qwen3-8B-opd-megatron.sh", tmp_path, env, "--num-rollout", "6",
                       "--rollout-batch-size", "8", "--global-batch-size", "16", "--lr", "1e-2", "--save-interval", "6")  # fmt: skip
    assert all("train/opd_reverse_kl" in r for r in rows) and len(rows) == 6
    before, after = _reverse_kl(student, teacher_run / "4"), _reverse_kl(tmp_path / "ckpt" / "6", teacher_run / "4")
    assert after < 0.7 * before, (before, after)  # 0.65 -> 0.35 (chat-templated prompts, 8 tokens)


@pytest.mark.slow
def test_opd_served_script_starts_its_teacher_and_distills(teacher_run, tmp_path):  # noqa: F811
    """vllm-project/vime's served-teacher script with `vime serve` as the teacher (--opd-type sglang): it
    waits for the server, every sample is scored by it, the reverse KL falls, and the server it
    started is gone when the script ends."""
    from vime.models import resolve_model

    student = resolve_model("tiny")
    env = {"MODEL_DIR": str(student), "TEACHER_DIR": str(teacher_run / "4"), "TEACHER_SERVER": "vime",
           "TEACHER_GPUS": "cpu", "TEACHER_PORT": str(_free_port()), "DATA_PATH": str(_dapo_style(tmp_path / "d.jsonl", 16))}  # fmt: skip
    rows = _run_script("on_policy_distillation/run-qwen3-8B-opd.sh", tmp_path, env, "--num-rollout", "6",
                       "--rollout-batch-size", "8", "--global-batch-size", "16", "--lr", "1e-2", "--save-interval", "6")  # fmt: skip
    assert all(r["rollout/reward_errors"] == 0 and "train/opd_reverse_kl" in r for r in rows) and len(rows) == 6
    before, after = _reverse_kl(student, teacher_run / "4"), _reverse_kl(tmp_path / "ckpt" / "6", teacher_run / "4")
    assert after < 0.7 * before, (before, after)  # 0.65 -> 0.35 (chat-templated prompts, 8 tokens)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(teacher_run / "4") not in ps


def test_a_gpqa_run_grades_eval_by_the_letter_and_checks_training_labels(tmp_path):
    """--rm-type gpqa without an eval rm type: held-out answers are graded by the option letter
    (not math's trailing number, which would score every letter 0), and a training label that
    names no option is refused at start-up as an eval one is."""
    from vime.config import parse_args
    from vime.models import load_tokenizer, resolve_model
    from vime.rollout.data.rows import DataError
    from vime.rollout.data.source import DataSource

    cfg = parse_args(["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "1", "--rm-type", "gpqa"])
    assert cfg.eval.rule(cfg.rollout.rm_type) == "gpqa"
    plain = parse_args(["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "1"])
    assert plain.eval.rule(plain.rollout.rm_type) == "math"
    data = tmp_path / "mc.jsonl"
    data.write_text('{"input": "Which? (A) x (B) y", "label": "A"}\n{"input": "Which? (A) x (B) y", "label": "y"}\n')
    cfg = parse_args(["--hf-checkpoint", "tiny", "--prompt-data", str(data), "--num-rollout", "1", "--rm-type", "gpqa"])
    with pytest.raises(DataError, match=r"row 1: label 'y' is not an option letter"):
        DataSource(cfg.rollout, load_tokenizer(resolve_model("tiny")))


def test_eval_calls_of_a_custom_generate_get_their_own_views_too():
    """An eval set's settings over a plug-in's args stay a PluginArgs: each eval call writes into
    its own view (as training's do), and the set's overrides apply."""
    from vime.eval_sets import args_for

    args = PluginArgs(Config(rollout_batch_size=4, eval_temperature=0.0).freeze(), runtime=None)
    set_args = args_for(args, {"name": "aime", "path": "/x.jsonl", "eval_temperature": 0.6})
    assert isinstance(set_args, PluginArgs) and set_args.eval_temperature == 0.6 and args.eval_temperature == 0.0
    one, other = set_args.for_call(), set_args.for_call()
    one.sample = "mine"
    assert not hasattr(other, "sample") and not hasattr(set_args, "sample")

"""Every input checked before anything starts (issue 12, vime/preflight.py): the run's files and
settings, each bad one a line of its own with no run directory made (a crafted or damaged
checkpoint: tests/unit/trainer/test_trainer_faults.py); every plug-in tried at start-up on
made-up input, one that does not fit refused in one line and one that fits passing; a plug-in
module that does not import, and a custom generate that fails, named with where."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil

import pytest
from conftest import ROOT, refused

from vime.rollout.types import Sample


def test_every_input_is_checked_before_anything_starts(tmp_path, tiny_model, monkeypatch):
    monkeypatch.chdir(ROOT)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen3", oops')
    long_rows = tmp_path / "long.jsonl"
    long_rows.write_text(
        "".join(json.dumps({"input": "9" * (600 if i == 3 else 3), "label": "9"}) + "\n" for i in range(6))
    )
    a_file = tmp_path / "file"
    a_file.write_text("")
    damaged = tmp_path / "ckpt" / "1"
    damaged.mkdir(parents=True)
    (damaged / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut short")
    cut_short, unweighted = tmp_path / "cut_short", tmp_path / "unweighted"
    for d in (cut_short, unweighted):
        shutil.copytree(tiny_model, d)
    weights = cut_short / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a copy or download that stopped halfway
    (unweighted / "model.safetensors").unlink()
    moe = tmp_path / "moe"  # transformers reads it; the built-in engine died at its start, a traceback shown
    shutil.copytree(tiny_model, moe)
    (moe / "config.json").write_text((moe / "config.json").read_text().replace('"qwen3"', '"qwen2_moe"'))
    cases = [
        (["--hf-checkpoint", str(broken)], "config.json is not valid JSON"),
        (
            ["--hf-checkpoint", str(cut_short)],
            "cut_short: model.safetensors is damaged .*: give a whole HF model directory",
        ),
        (["--hf-checkpoint", str(unweighted)], "unweighted: no model.safetensors: give a whole HF model directory"),
        (["--rollout-health-check-timeout", "0"], "--rollout-health-check-timeout must be > 0 seconds"),
        (["--eval-limit", "-1"], "--eval-limit -1: give at least 1"),
        (["--rollout-health-check-interval", "-1"], "--rollout-health-check-interval must be >= 0 seconds"),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be at least 1"),
        (["--rollout-temperature", "nan"], "--rollout-temperature nan: give a finite number"),
        (
            ["--custom-generate-function-path", "nope.missing"],
            "--custom-generate-function-path 'nope.missing' cannot be loaded",
        ),
        (["--eval-interval", "1", "--eval-prompt-data", str(tmp_path / "nope.jsonl")], "nope.jsonl not found"),
        (["--save", str(a_file / "ckpt")], f"--save {a_file}/ckpt is not writable"),
        (
            ["--prompt-data", str(long_rows)],
            "long.jsonl row 3: the prompt is 600 tokens, the model takes at most 511 .* --skip-overlong-prompts",
        ),
        (["--eval-interval", "1", "--eval-prompt-data", str(long_rows)], "long.jsonl row 3"),
        (["--load", str(tmp_path / "ckpt")], "no intact checkpoint"),
        (
            ["--hf-checkpoint", str(moe)],
            "model_type 'qwen2_moe' in .*moe/config.json is not supported by the vime engine \\(supported: llama, qwen2, "
            "qwen3, qwen3_moe, mixtral\\); --rollout-backend vime cannot generate with it",
        ),
        (  # taken unsaid: no response can be longer than the context
            ["--rollout-max-response-len", "10000000"],
            "--rollout-max-response-len 10000000 is not below the model's context \\(config.json\\) of 512 tokens: a "
            "response has at most 511",
        ),
        (
            ["--eval-interval", "1", "--eval-max-response-len", "512"],
            "--eval-max-response-len 512 is not below the model's context",
        ),
    ]
    for argv, match in cases:
        assert re.search(match, refused(tmp_path, *argv)), argv

    from vime.cli import eval_main
    from vime.errors import VimeError

    with pytest.raises(VimeError, match="cut_short: model.safetensors is damaged") as e:  # `vime eval` of it too
        eval_main(
            ["--config", "examples/tiny.yaml", "--hf-checkpoint", str(cut_short), "--runs-dir", str(tmp_path / "ev")]
        )
    assert "\n" not in str(e.value) and not (tmp_path / "ev").exists()
    if os.geteuid() != 0:  # root writes through file modes
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        assert "is not writable (Permission denied)" in refused(tmp_path, "--save", str(read_only / "ckpt"))


def test_skip_overlong_prompts_leaves_them_out_and_counts_them(tmp_path, tiny_model):
    from vime.config import parse_args
    from vime.models import load_tokenizer
    from vime.rollout.data.rows import DataError
    from vime.rollout.data.source import DataSource

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input": "9" * n, "label": "9"}) + "\n" for n in (3, 50, 4, 60)))
    args = parse_args(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(rows),
            "--num-rollout",
            "1",
            "--skip-overlong-prompts",
        ]
    )
    ds = DataSource(args, load_tokenizer(tiny_model), max_prompt_len=20)
    assert len(ds) == 2 and ds.skipped_prompts == 2
    assert {g[0].prompt for g in ds.get_samples(2)} == {"999", "9999"}
    args.skip_overlong_prompts = False
    with pytest.raises(DataError, match="row 1: the prompt is 50 tokens"):
        DataSource(args, load_tokenizer(tiny_model), max_prompt_len=20)


# ---- plug-ins: tried at start-up (their faults in a run: tests/e2e/test_faults.py) -------------

CUSTOM_LOSS = ["--loss-type", "custom_loss", "--custom-loss-function-path"]


# each plug-in flag with a function that does not fit, and the one line that refuses it
MISFITS = [
    (
        ["--dynamic-sampling-filter-path", "varied_reward.float_filter"],
        "on group 0 returned 0.0: it must return a bool",
    ),
    (
        ["--dynamic-sampling-filter-path", "varied_reward.filter_reading_a_missing_key"],
        "on group 0 raised KeyError: 'difficulty' (VIME_DEBUG=1 shows its traceback)",
    ),
    (["--dynamic-sampling-filter-path", "varied_reward.filter_with_a_numeric_reason"], "a .reason of type int"),
    (
        ["--dynamic-sampling-filter-path", "varied_reward.filter_of_one_argument"],
        "cannot be called as fn(args, samples)",
    ),
    (
        ["--custom-advantage-function-path", "custom_algorithms.advantages_per_group"],
        "returned advantages of shape (2,), the rollout's rewards are (2, 4) (groups × samples)",
    ),
    (
        ["--custom-advantage-function-path", "custom_algorithms.advantages_that_divide_by_zero"],
        "raised ZeroDivisionError: division by zero",
    ),
    (["--custom-advantage-function-path", "custom_algorithms.advantages_as_none"], "returned NoneType: return a"),
    ([*CUSTOM_LOSS, "custom_algorithms.loss_one_short"], "a per-token loss Tensor of shape (6,) for 7 tokens"),
    ([*CUSTOM_LOSS, "custom_algorithms.detached_loss"], "returned a per-token loss with no gradient"),
    (
        [*CUSTOM_LOSS, "custom_algorithms.loss_with_a_scalar_metric_per_sequence"],
        "returned metric 'per_sequence' of shape (2,) for 7 tokens",
    ),
    (
        [*CUSTOM_LOSS, "custom_algorithms.loss_without_seq_ids"],
        "cannot be called as fn(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids)",
    ),
    (["--custom-tis-function-path", "custom_algorithms.tis_one_mask_short"], "returned 1 loss_masks for 2 sequences"),
    (["--custom-tis-function-path", "custom_algorithms.tis_summed"], "a pg_loss Tensor of shape () for 7 tokens"),
    (["--custom-tis-function-path", "custom_algorithms.tis_pair"], "returned a tuple of 2: it must return (pg_loss"),
    (["--custom-rm-path", "varied_reward.reward_as_text"], "returned 'right' (str): it must return a number"),
    (["--custom-rm-path", "varied_reward.reward_forgotten"], "returned None (NoneType): it must return a number"),
    (["--custom-rm-path", "varied_reward.reward_of_the_sample_alone"], "cannot be called as fn(args, sample)"),
    (["--custom-generate-function-path", "fault_plugins.generate_not_async"], "is not a coroutine function"),
    (
        ["--custom-generate-function-path", "fault_plugins.generate_of_two_arguments"],
        "cannot be called as async generate(args, sample, sampling_params)",
    ),
    (
        ["--rollout-function-path", "fault_plugins.rollout_of_two_arguments"],
        "cannot be called as generate_rollout(args, rollout_id, data_source, evaluation=False)",
    ),
]


def test_every_plugin_is_tried_at_start_up_and_one_that_does_not_fit_is_one_line(tmp_path, tiny_model, monkeypatch):
    monkeypatch.chdir(ROOT)
    for argv, fault in MISFITS:
        msg = refused(tmp_path, *argv)
        assert f"{argv[-2]} {argv[-1]}" in msg and fault in msg, (argv, msg)
        # how it is called is checked as it loads; what it answers on made-up input, after the data is read
        assert msg.startswith("start-up check, on made-up input: ") or "cannot be called as" in msg, msg


def test_plugins_that_fit_pass_their_start_up_check_and_a_reward_that_raises_is_a_note(tmp_path, monkeypatch):
    from vime.config import parse_args
    from vime.plugins import Plugin
    from vime.preflight import check_inputs

    monkeypatch.chdir(ROOT)
    args = parse_args(
        [
            "--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(tmp_path),
            "--rollout-function-path", "fault_plugins.inf_rewards_from_step_two",
            "--custom-generate-function-path", "fault_plugins.slow_grading",
            "--dynamic-sampling-filter-path",
            "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback",
            "--custom-advantage-function-path", "custom_algorithms.doubled_grpo",
            *CUSTOM_LOSS, "custom_algorithms.reinforce_loss",
            "--custom-tis-function-path", "custom_algorithms.halve_tis",
            "--custom-rm-path", "varied_reward.reward_that_raises",
        ]
    )  # fmt: skip
    inputs = check_inputs(args)
    assert isinstance(inputs.rollout_fn, Plugin) and isinstance(inputs.custom_advantages, Plugin)
    assert any(
        n.startswith("--custom-rm-path varied_reward.reward_that_raises raised ZeroDivisionError: division by zero")
        and "counts in rollout/reward_errors" in n
        for n in inputs.notes
    ), inputs.notes


def test_a_custom_generate_that_raises_or_returns_no_sample_names_the_sample_and_the_step():
    from vime.plugins import PluginError, at_step
    from vime.rollout.generate import custom_generate

    for name, fault in (
        ("generate_that_raises", "raised KeyError: 'tool_calls'"),
        ("generate_returning_nothing", "returned NoneType: it must return the Sample it was given"),
    ):
        with pytest.raises(PluginError) as e, at_step(4):
            asyncio.run(custom_generate(f"fault_plugins.{name}")(None, Sample(index=13), {}))
        assert str(e.value).startswith(
            f"step 4: --custom-generate-function-path fault_plugins.{name} on sample 13 {fault}"
        )


def test_a_plugin_module_that_does_not_import_is_one_line_naming_where(tmp_path, monkeypatch):
    from vime.config import ConfigError
    from vime.plugins import load_function

    (tmp_path / "rm_syntax.py").write_text("def reward(args, sample):\n    return 1 +\n")
    (tmp_path / "rm_raises.py").write_text("import os\nKEY = os.environ['VIME_NO_SUCH_VARIABLE']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"--custom-rm-path 'rm_syntax:reward': .*rm_syntax.py:2: invalid syntax \(fix the module\)$"
    ) as e:
        load_function("rm_syntax:reward", "--custom-rm-path")
    assert "\n" not in str(e.value)
    with pytest.raises(
        ConfigError, match=r"importing rm_raises raised KeyError: 'VIME_NO_SUCH_VARIABLE' \(fix the module\)$"
    ):
        load_function("rm_raises:reward", "--custom-rm-path")


def test_a_stop_token_id_past_the_vocabulary_is_refused(tmp_path):
    """An id the model has no token for never stopped an answer, unsaid (the tiny model has 100)."""
    msg = refused(tmp_path, "--rollout-stop-token-ids", "5,100")
    assert msg.startswith("--rollout-stop-token-ids 100: the model's vocabulary has 100 tokens")

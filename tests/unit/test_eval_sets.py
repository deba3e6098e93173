"""Several held-out sets in one run (--eval-prompt-data pairs, --eval-config), --eval-top-k,
--custom-config-path, and the one error that names every flag vime does not know."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli, train_here

from vime import compat
from vime.config import Config, ConfigError, build_parser, parse_args
from vime.preflight import startup_notes
from vime.rollout.generate import sampling_params

BASE = ["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "2"]
TEST = "examples/data/addition/test.jsonl"

# three sets of one file, each with settings of its own: visible in what was evaluated
THREE_SETS = {
    "eval": {
        "defaults": {"max_response_len": 3, "temperature": 1.0},
        "datasets": [
            {"name": "short", "path": TEST, "limit": 3, "max_response_len": 1},
            # top-k 1 samples the most likely token: both samples of a prompt are the same
            {"name": "topk", "path": TEST, "limit": 4, "n_samples_per_eval_prompt": 2, "top_k": 1},
            {"name": "sampled", "path": TEST, "limit": 4, "n_samples_per_eval_prompt": 2},
            # boxed_math reads only a \boxed{} answer, which the tiny model never writes
            {"name": "boxed", "path": f"{TEST}@[10:20]", "limit": 5, "rm_type": "boxed_math"},
        ],
    }
}


def _write(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _tiny_without_eval(tmp_path: Path) -> Path:
    """examples/tiny.yaml without its eval set, with paths from the repository root."""
    cfg = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    del cfg["eval_prompt_data"]
    return _write(tmp_path / "tiny.yaml", cfg)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_several_sets_in_one_sync_run_each_with_its_own_settings(tmp_path):
    sets = _write(tmp_path / "evals.yaml", THREE_SETS)
    train_here(  # in this process: the test reads what the run wrote
        "train.py",
        "--config",
        str(_tiny_without_eval(tmp_path)),
        "--num-rollout",
        "1",
        "--eval-interval",
        "1",
        "--eval-config",
        str(sets),
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "r",
    )
    run = tmp_path / "r"
    evals = [r for r in _rows(run / "metrics.jsonl") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for row in evals:
        assert {n: row[f"eval/{n}/total"] for n in ("short", "topk", "sampled", "boxed")} == {
            "short": 3,
            "topk": 8,
            "sampled": 8,
            "boxed": 5,
        }
        assert row["eval/total"] == 24 and row["eval/correct"] == sum(
            row[f"eval/{n}/correct"] for n in ("short", "topk", "sampled", "boxed")
        )
        assert row["eval/short/response_len_mean"] == 1 and row["eval/boxed/response_len_mean"] <= 3
    short, topk, sampled, boxed = (_rows(run / "eval" / n / "0.jsonl") for n in ("short", "topk", "sampled", "boxed"))
    assert len(short) == 3 and all(r["response_length"] == 1 for r in short)
    # top-k 1 reached the engine: the two samples of each prompt agree; at temperature 1 without it they do not
    assert [r["response"] for r in topk[::2]] == [r["response"] for r in topk[1::2]]
    assert [r["response"] for r in sampled[::2]] != [r["response"] for r in sampled[1::2]]
    assert all(r["pred"] is None for r in boxed)  # graded by its rm type: no box, no answer
    assert any(r["pred"] is not None for r in short + topk + sampled)  # math's rule reads a trailing number
    log = (run / "log.txt").read_text()
    assert "eval step 1: short 0.000 (0/3) | topk " in log and "| all " in log
    assert "| eval 0.000 (short 0.000 topk 0.000 sampled 0.000 boxed 0.000) |" in log
    from vime.report import main as report

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report([str(run), "--no-plots"])
    assert "accuracy per eval set" in printed.getvalue() and "| r | boxed | 0.0% | 0/5 | +0.0 |" in printed.getvalue()


def test_vime_eval_evaluates_each_set_of_the_command_line(tmp_path):
    out = run_cli(
        "-m",
        "vime",
        "eval",
        "--hf-checkpoint",
        "tiny",
        "--eval-prompt-data",
        "first",
        TEST,
        "second",
        f"{TEST}@[5:20]",
        "--eval-limit",
        "2",
        "--eval-max-response-len",
        "2",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "ev",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("first accuracy") and str(tmp_path / "ev" / "eval.first.jsonl") in lines[0]
    assert lines[1].startswith("second accuracy") and lines[2].startswith("all accuracy")
    result = json.loads(lines[-1])
    assert (result["eval/first/total"], result["eval/second/total"], result["eval/total"]) == (2, 2, 4)
    assert [r["prompt"] for r in _rows(tmp_path / "ev" / "eval.second.jsonl")] == [
        r["input"] for r in _rows(ROOT / TEST)[5:7]
    ]


def test_one_set_keeps_the_metric_names_and_lines_it_always_had():
    from vime.eval import result_line
    from vime.metrics import progress_postfix

    cfg = parse_args([*BASE, "--eval-prompt-data", "aime", "/e/aime.jsonl"])
    assert cfg.eval_sets == [{"name": "aime", "path": "/e/aime.jsonl"}]
    m = {"eval/accuracy": 0.25, "eval/correct": 1, "eval/total": 4}
    assert result_line(m, 3, "aime") == "eval aime step 3: accuracy 0.250 (1/4)"
    assert progress_postfix(m)["eval"] == "0.250"
    assert parse_args([*BASE, "--eval-prompt-data", "/e/x.jsonl"]).eval_sets == [{"name": None, "path": "/e/x.jsonl"}]


def test_eval_config_forms_defaults_and_overrides(tmp_path):
    mapping = {
        "defaults": {"top_p": 0.7, "n_samples_per_eval_prompt": 4},
        "datasets": {"aime": {"path": "/a.jsonl", "rm_type": "deepscaler"}, "gsm": {"path": "/g.jsonl", "top_p": 0.9}},
    }
    cfg = parse_args([*BASE, "--eval-config", str(_write(tmp_path / "e.yaml", mapping))])
    assert cfg.eval_sets == [
        {
            "name": "aime",
            "path": "/a.jsonl",
            "eval_top_p": 0.7,
            "n_samples_per_eval_prompt": 4,
            "eval_rm_type": "deepscaler",
        },
        {"name": "gsm", "path": "/g.jsonl", "eval_top_p": 0.9, "n_samples_per_eval_prompt": 4},
    ]
    from vime.eval_sets import args_for

    per_set = args_for(cfg, cfg.eval_sets[1])
    assert (per_set.eval_top_p, per_set.n_samples_per_eval_prompt, cfg.eval_top_p) == (0.9, 4, None)
    # a run's config.yaml reads back as the same sets
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert parse_args(["--config", str(tmp_path / "config.yaml")]).eval_sets == cfg.eval_sets


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("eval: [oops", "is not valid YAML"),
        ({"eval": {"datasets": []}}, "defines no sets"),
        ({"eval": {"datasets": [{"path": "/a"}]}}, r"eval.datasets\[0\] has no name"),
        ({"eval": {"datasets": [{"name": "a"}]}}, "set a has no path"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a", "temprature": 1}]}}, "did you mean temperature"),
        ({"eval": {"defaults": {"top_q": 1}, "datasets": [{"name": "a", "path": "/a"}]}}, "eval.defaults: unknown key"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a", "repetition_penalty": 1.1}]}}, "no counterpart in vime"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a", "top_p": 0}]}}, r"set a: top_p 0.0 must be in \(0, 1\]"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a", "limit": "ten"}]}}, "set a: limit: cannot read 'ten'"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a", "rm_type": "gqpa"}]}}, "rm_type 'gqpa': use one of"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a", "rm_type": "ifbench"}]}}, r"rm_type 'ifbench' \(IFBench's"),
        ({"eval": {"datasets": [{"name": "a/b", "path": "/a"}]}}, "cannot be a metric name"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]}}, "given twice"),
        ({"eval": {"datasets": [{"name": "a", "path": "${oc.env:HOME}/a"}]}}, "OmegaConf interpolation"),
        ({"eval": {"datasets": [{"name": "a", "path": "/a"}]}, "trainer": {}}, "unknown key 'trainer'"),
        # the engine refused these at the set's first request, mid-run
        (
            {"eval": {"datasets": [{"name": "a", "path": "/a", "stop_token_ids": ["x"]}]}},
            "stop_token_ids.*whole number",
        ),
        ({"eval": {"datasets": [{"name": "a", "path": "/a", "stop_token_ids": [-3]}]}}, "stop_token_ids.*whole number"),
        (
            {"eval": {"datasets": [{"name": "a", "path": "/a", "stop": ["a", ""]}]}},
            "every stop string must be non-empty",
        ),
    ],
)
def test_a_bad_eval_config_is_one_line(tmp_path, content, fragment):
    path = tmp_path / "e.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    with pytest.raises(ConfigError, match=fragment) as e:
        parse_args([*BASE, "--eval-config", str(path)])
    assert "\n" not in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--eval-config", "/no/such.yaml"], "no such file"),
        (["--eval-config", "e.yaml", "--eval-prompt-data", "/a"], "both name the held-out sets"),
        (["--eval-prompt-data", "a", "/a", "b"], "NAME PATH pairs"),
        (["--eval-prompt-data", "a", "/a", "b", "/b", "--eval-name", "x"], "drop --eval-name"),
        (["--eval-top-k", "-2"], "--eval-top-k must be"),
        (["--eval-rm-type", "gqpa"], "--eval-rm-type 'gqpa'"),
    ],
)
def test_bad_eval_flags_are_one_line(extra, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_args([*BASE, *extra])


def test_eval_top_k_is_sent_with_eval_requests():
    base = dict(rollout_top_k=20, eval_max_response_len=8)
    assert sampling_params(Config(**base, eval_top_k=1), evaluation=True)["top_k"] == 1
    assert sampling_params(Config(**base, eval_top_k=5, n_samples_per_eval_prompt=4), evaluation=True)["top_k"] == 5
    assert sampling_params(Config(**base, eval_top_k=5))["top_k"] == 20  # training keeps the rollout's
    assert parse_args([*BASE, "--eval-top-k", "1", "--eval-top-p", "0.5"]).eval_top_k == 1


MIS = """\
use_tis: true
tis_level: sequence
rs_veto_threshold: 1.0e-4
rs_lower_bound: null
tis_batch_normalize: true
tis_upper_bound: 2.0
"""


def test_custom_config_overrides_flags_and_hands_other_keys_to_plugins(tmp_path):
    (tmp_path / "mis.yaml").write_text(MIS)
    cfg = parse_args([*BASE, "--custom-config-path", str(tmp_path / "mis.yaml"), "--tis-level", "token"])
    assert cfg.use_tis and cfg.tis_level == "sequence" and cfg.rs_veto_threshold == 1e-4  # over the command line
    assert cfg.rs_lower_bound == Config().rs_lower_bound  # null: not set
    assert (cfg.tis_batch_normalize, cfg.tis_upper_bound) == (True, 2.0)  # what slime's mis.py reads from args
    assert cfg.custom_config == {"tis_batch_normalize": True, "tis_upper_bound": 2.0}
    again = pickle.loads(pickle.dumps(cfg))  # as trainer ranks get it
    assert again.tis_batch_normalize is True
    said = " ".join(startup_notes(cfg))
    assert "--custom-config-path" in said and "tis_batch_normalize, tis_upper_bound" in said
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert parse_args(["--config", str(tmp_path / "config.yaml")]).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("rollout_batch_size: 4.5\n", "--rollout-batch-size: cannot read 4.5 as a whole number"),
        ("rollout_top_p: 0\n", r"--rollout-top-p must be in \(0, 1\]"),
        ("tis_level: cubic\n", "--tis-level 'cubic': use one of"),
        ("mode: sync\n", "'mode' is derived by vime"),
        ("validate: 1\n", "cannot be an attribute of args"),
        ("lr: 1\nlr: 2\n", "'lr' is given twice"),
    ],
)
def test_custom_config_values_are_checked_as_flags_are(tmp_path, text, fragment):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        parse_args([*BASE, "--custom-config-path", str(tmp_path / "c.yaml")])


def test_every_unknown_flag_is_named_at_once_with_what_it_is_in_slime(capsys):
    argv = [*BASE, "--keep-old-actor", "--ref-update-interval", "5"]
    argv += ["--rollout-batchsize", "4", "--multimodal-keys", '{"image": "images"}', "--use-stateless-adam"]
    from vime.compat import parse_args as parse_slime_script  # the flags of a script written for slime

    with pytest.raises(SystemExit) as refused:
        parse_slime_script(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[0].startswith("train.py: error: unrecognized arguments: --keep-old-actor")
        and "(5 flags vime does not know)" in err[0]
    )
    by_flag = {line.split()[0].rstrip(":"): line for line in err[1:-1]}
    assert list(by_flag) == [
        "--keep-old-actor",
        "--ref-update-interval",
        "--rollout-batchsize",
        "--multimodal-keys",
        "--use-stateless-adam",
    ]
    assert "--off-policy-correction" in by_flag["--keep-old-actor"]
    assert "not in vime yet" in by_flag["--ref-update-interval"]
    assert "did you mean --rollout-batch-size?" in by_flag["--rollout-batchsize"]
    assert "text models only" in by_flag["--multimodal-keys"]
    # slime's reward post-process is a vime flag now (OPD with a served teacher needs it)
    assert parse_args([*BASE, "--custom-reward-post-process-path", "m.f"]).custom_reward_post_process_path == "m.f"


def test_no_flag_of_the_absent_table_is_one_vime_accepts_and_the_docs_list_them():
    """A flag vime gains (OPD, --rm-url, ...) leaves the table of those it lacks."""
    known = {o for a in build_parser()._actions for o in a.option_strings}
    doc = (ROOT / "docs" / "slime-flags.md").read_text()
    for row in compat.ABSENT.values():
        assert f"`{row.flag}`" in doc, row.flag
        if row.name.endswith("*"):
            assert not any(k.startswith(row.flag[:-1]) for k in known), row.flag
        else:
            assert row.flag not in known, row.flag


def test_vime_eval_refuses_load_which_it_would_not_evaluate():
    """`vime eval --load CKPT` was taken and dropped: the base model's accuracy was printed as the
    checkpoint's."""
    with pytest.raises(ConfigError, match=r"--load ck: vime eval does not resume a run, .*--hf-checkpoint ck/<step>"):
        parse_args(["--hf-checkpoint", "tiny", "--eval-prompt-data", "/a", "--load", "ck"], entry="eval")

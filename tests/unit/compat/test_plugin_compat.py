"""vllm-project/vime's plug-in API (docs/plugin-compat.md): its names, a generate that returns
several samples, dict labels, and a plug-in that does not fit refused at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, run_cli, train_here
from safetensors.torch import load_file

from vime.rollout.data.rows import DataError, load_prompts

ROWS = [{"input": f"{a}+{b}=", "label": {"ground_truth": {"target": [str(a + b)]}}} for a in range(4) for b in range(3)]
FULLY_ASYNC = ("--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async")


@pytest.fixture(scope="module")
def dict_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dict") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_dict_labels_load_as_dicts_from_jsonl_and_parquet(dict_data, tmp_path):
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    for path in (dict_data, parquet):
        rows = load_prompts(path)
        assert rows[5]["label"] == ROWS[5]["label"], path  # the dict, not its JSON text
    assert load_prompts(dict_data, label_key="label.ground_truth")[0]["label"] == {"target": ["0"]}


def test_a_dict_label_with_a_builtin_grader_is_one_line(dict_data):
    with pytest.raises(DataError, match=r"row 0 \(line 1\): 'label' is a dict, and --rm-type math compares"):
        load_prompts(dict_data, grader="--rm-type math")


def run_tiny(tmp_path: Path, data: Path, tiny_model: Path, *extra: str) -> None:
    """A two-step run of the tiny model on `data` (fully-async when `extra` asks for it), saving
    to tmp_path/ckpt: the frame of the tests of plug-ins written its way, `extra` their plug-ins. In this
    process (train_here): the tests read what the run wrote."""
    train_here(
        "train_async.py" if FULLY_ASYNC[1] in extra else "train.py",
        "--hf-checkpoint", str(tiny_model), "--prompt-data", str(data),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--num-rollout", "2", "--lr", "1e-2", "--max-tokens-per-gpu", "512",
        "--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"),
        *extra,
    )  # fmt: skip


TWO_AGENTS = (
    "--custom-generate-function-path", "upstream_plugins.generate_two_agents",
    "--custom-rm-path", "upstream_plugins.loads_itself",
)  # fmt: skip


@pytest.mark.parametrize("mode", [(), FULLY_ASYNC], ids=["sync", "fully-async"])
def test_an_upstream_style_multi_agent_plugin_trains_every_sample_it_returns(mode, tmp_path, dict_data, tiny_model):
    run_tiny(tmp_path, dict_data, tiny_model, *TWO_AGENTS, *mode)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/num_samples"] == 2 * 2 * 2  # every prompt's 2 samples each came back as 2
        assert r["rollout/reward_errors"] == 0  # the reward saw the data's dict labels
    assert any(r["train/grad_norm"] > 0 for r in steps)
    trained = load_file(next((tmp_path / "ckpt").glob("*/model.safetensors")))
    start = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the samples were trained on


@pytest.mark.parametrize(
    ("plugin", "says"),
    [
        ("upstream_misfits.generate", "upstream_misfits.generate reads args.keep_old_actor, which vime does not have"),
        ("upstream_megatron.generate", "imports vime.backends.megatron_utils.model, which vime does not have"),
    ],
)
def test_a_plugin_that_does_not_fit_is_refused_in_one_line_at_start_up(plugin, says, tmp_path, dict_data, tiny_model):
    res = run_cli(
        "train.py", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(dict_data),
        "--custom-generate-function-path", plugin, "--custom-rm-path", "upstream_plugins.first_token_parity",
        "--runs-dir", str(tmp_path), "--num-rollout", "1",
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert says in res.stderr and "Traceback" not in res.stderr
    assert len([line for line in res.stderr.splitlines() if says in line]) == 1


def test_only_the_runs_args_are_judged_not_a_variable_of_that_name(tmp_path, monkeypatch):
    """A module's own `args` (a list, argparse's namespace) is not vime's: only `args.NAME` inside
    a function that takes `args` counts (test_vllm_runs.py's plug-ins, beside tests that build
    command lines as `args`, were refused for `args.index`)."""
    from vime.config import Config
    from vime.plugin_checks import _check_args_read
    from vime.plugins import load_plugin

    (tmp_path / "own_args.py").write_text(
        "args = ['--num-rollout', '2']\n"
        "args[args.index('--num-rollout') + 1] = '5'\n"
        "def main():\n    args = object()\n    return args.whatever\n"
        "async def generate(args, sample, params):\n    return sample if args.rollout_batch_size else None\n"
    )
    (tmp_path / "upstream_args.py").write_text(
        "async def generate(args, sample, params):\n    return args.keep_old_actor\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _check_args_read(load_plugin("own_args.generate", "--custom-generate-function-path"), Config())
    with pytest.raises(Exception, match="reads args.keep_old_actor, which vime does not have"):
        _check_args_read(load_plugin("upstream_args.generate", "--custom-generate-function-path"), Config())


WRITES = {
    "sets": "args.lr = 5.0",
    "deletes": "del args.lr",
    "writes_vars": "vars(args)['lr'] = 5.0",
}


def _tiny_args(tmp_path: Path, *extra: str):
    from conftest import ROOT

    from vime.config import parse_args

    return parse_args(
        ["--config", str(ROOT / "examples/tiny.yaml"), "--num-rollout", "1", "--runs-dir", str(tmp_path / "runs"),
         "--prompt-data", str(ROOT / "examples/data/addition/train.jsonl"),
         "--eval-prompt-data", str(ROOT / "examples/data/addition/test.jsonl"), *extra]
    )  # fmt: skip


@pytest.mark.parametrize("how", list(WRITES))
def test_a_reward_that_writes_a_setting_is_refused_at_start_up_and_the_run_keeps_it(how, tmp_path, monkeypatch):
    """A reward that set `args.lr` trained the run at that lr (the start-up check handed it the
    plain config before it was frozen); now its start-up call gets the read-only view, and the
    write is one line naming the reward and the setting. The settings passed in are untouched."""
    from vime.plugins import PluginError
    from vime.preflight import check_inputs

    (tmp_path / "writer.py").write_text(f"def reward(args, sample):\n    {WRITES[how]}\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _tiny_args(tmp_path, "--custom-rm-path", "writer.reward")
    with pytest.raises(PluginError) as e:
        check_inputs(cfg)
    assert str(e.value).startswith("start-up check, on made-up input: --custom-rm-path writer.reward raised")
    assert "args.lr: a setting of the run, read-only in a plug-in" in str(e.value) and "\n" not in str(e.value)
    assert cfg.lr == 1e-3


def test_the_runs_reward_gets_the_runs_read_only_view(tmp_path, monkeypatch):
    """In the run, a custom reward is handed the run's own view (its live runtime on it), as every
    other plug-in is; a write is refused there too and the run trains at its own lr."""
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "watcher.py").write_text(
        "import json, os\n"
        "def reward(args, sample):\n"
        "    try:\n        args.lr = 5.0\n        wrote = True\n"
        "    except AttributeError:\n        wrote = False\n"
        "    vars(args._config)['lr'] = 5.0  # past the view, into its own config: a copy of the run's\n"
        "    with open(os.environ['SEEN'], 'a') as f:\n"
        "        f.write(json.dumps({'runtime': args.runtime is not None, 'wrote': wrote}) + '\\n')\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SEEN", str(seen))
    runs = tmp_path / "runs"
    train_here(
        "sync", "--config", "examples/tiny.yaml", "--num-rollout", "1", "--custom-rm-path", "watcher.reward",
        "--runs-dir", str(runs), "--run-name", "w",
    )  # fmt: skip
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert calls[0] == {"runtime": False, "wrote": False}  # the start-up check: no engines yet
    assert len(calls) == 17 and all(c == {"runtime": True, "wrote": False} for c in calls[1:])
    row = json.loads((runs / "w" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["train/lr"] == pytest.approx(1e-3)


def test_a_loss_hook_cannot_delete_a_setting_under_the_trainer():
    """The custom loss and TIS hooks are bound to a read-only view of the trainer's config: a
    `del args.lr` fell back to the class default lr for the rest of the run."""
    from vime.algorithms.objective import Objective
    from vime.config import Config
    from vime.plugins import PluginError

    cfg = Config(loss_type="custom_loss", custom_loss_function_path="custom_algorithms.deleting_loss", lr=1e-3)
    objective = Objective.of(cfg.freeze())
    with pytest.raises(PluginError, match=r"deleting_loss raised SettingWriteError: args\.lr: a setting of the run"):
        objective.custom_loss(
            log_probs=torch.zeros(2), old_log_probs=torch.zeros(2), advantages=torch.zeros(2),
            loss_mask=torch.ones(2), rollout_log_probs=torch.zeros(2), seq_ids=torch.zeros(2, dtype=torch.long),
        )  # fmt: skip
    assert cfg.lr == 1e-3


def test_the_args_check_names_the_function_that_reads(tmp_path, monkeypatch):
    """The module-wide check of `args.NAME` reads named the configured function when another
    function of its module was the reader."""
    from vime.config import Config
    from vime.plugin_checks import _check_args_read
    from vime.plugins import load_plugin

    (tmp_path / "helped.py").write_text(
        "def helper(args):\n    return args.keep_old_actor\n"
        "def reward(args, sample):\n    return float(helper(args) is None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Exception) as e:
        _check_args_read(load_plugin("helped.reward", "--custom-rm-path"), Config())
    assert str(e.value).startswith(
        "--custom-rm-path helped.reward: helped.helper reads args.keep_old_actor, which vime does not have"
    )


def test_a_name_an_installed_slime_lacks_is_blamed_on_that_slime(tmp_path):
    """With a real `slime` package first on the path, vime's alias stands aside, and a plug-in's
    `from slime.utils.types import Sample` fails in that slime: the refusal said vime lacked it."""
    import subprocess
    import sys

    (tmp_path / "slime").mkdir()
    (tmp_path / "slime" / "__init__.py").write_text("")
    (tmp_path / "upstream_style.py").write_text(
        "from slime.utils.types import Sample\ndef reward(args, sample):\n    return 1.0\n"
    )
    code = (  # slime's dialect installed as vime's entry points install it
        "from vime.compat import SLIME\nfrom vime.plugins import load_function\nSLIME.install()\n"
        "try:\n    load_function('upstream_style.reward', '--custom-rm-path')\n"
        "except Exception as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    said = out.stdout.strip()
    assert said.startswith(
        f"--custom-rm-path 'upstream_style.reward' imports slime.utils, which the installed slime package "
        f"({tmp_path}/slime/__init__.py) does not have"
    ), out.stdout + out.stderr


def test_the_vllm_shaped_route_passes_the_engines_sampling_keys_and_names_the_rest():
    """vllm-project/vime's plug-ins post vLLM's sampling keys: those the engines take (min_p and
    the penalties among them) go through under vime's names, any other is refused by name, never
    dropped (dropped, the request would sample from another distribution than asked)."""
    from vime.compat.router import RequestError, engine_params

    body = {"sampling_params": {"max_tokens": 4, "seed": 3, "min_p": 0.2, "presence_penalty": 0.5}}
    assert engine_params(body, 16) == {"max_new_tokens": 4, "sampling_seed": 3, "min_p": 0.2, "presence_penalty": 0.5}
    with pytest.raises(RequestError, match="min_tokens"):
        engine_params({"sampling_params": {"min_tokens": 2}}, 16)


def test_a_reward_cannot_change_the_runs_sampling_through_nested_or_component_values(tmp_path, monkeypatch):
    """A reward that appended to `args.rollout_stop` or wrote past the frozen `args.rollout` with
    `object.__setattr__` changed what the run's own rollout sampled from its next call on (step 2's
    answers one token long), and its start-up call's append reached the run's first call; `type(args).lr`
    answered every view's `args.lr`. Each call now sees the run's values, and the class refuses."""
    from vime.plugin_args import PluginArgs
    from vime.plugins import SettingWriteError

    seen = tmp_path / "seen.jsonl"
    (tmp_path / "nested.py").write_text(
        "import json, os\n"
        "def reward(args, sample):\n"
        "    with open(os.environ['SEEN'], 'a') as f:\n"
        "        f.write(json.dumps([args.rollout.rollout_max_response_len, args.rollout_stop]) + '\\n')\n"
        "    object.__setattr__(args.rollout, 'rollout_max_response_len', 1)\n"
        "    args.rollout_stop.append('+')\n"
        "    vars(args)['rollout_stop_token_ids'].append(0)\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SEEN", str(seen))
    runs = tmp_path / "runs"
    train_here(
        "sync", "--config", "examples/tiny.yaml", "--num-rollout", "2", "--custom-rm-path", "nested.reward",
        "--runs-dir", str(runs), "--run-name", "n",
    )  # fmt: skip
    assert {line for line in seen.read_text().splitlines()} == {"[4, []]"}
    rows = [json.loads(line) for line in (runs / "n" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/response_len_max"] for r in rows if "rollout/response_len_max" in r] == [4, 4]
    with pytest.raises(SettingWriteError, match="args.lr"):
        PluginArgs.lr = 5.0


@pytest.mark.parametrize(
    "change, says",
    [
        ("sample.response_length = 50", "has response_length 50 for"),  # an IndexError inside the trainer
        (
            "sample.tokens = list(sample.tokens[:-1]) + [10**6]",
            "holds token id 1000000 (outside the model's vocabulary",
        ),
    ],
)
def test_a_sample_a_reward_broke_is_one_line_naming_the_plugin(change, says, tmp_path, monkeypatch):
    """A reward that changed its sample so that the trainer could not index it (its start-up call
    changed only the made-up one) ended step 1 in a traceback from the trainer's packing."""
    from vime.cli import train_main
    from vime.plugins import PluginError

    module = f"breaker{len(change)}"  # a module of its own per case: the first stays imported
    (tmp_path / f"{module}.py").write_text(
        f"def reward(args, sample):\n    if args.runtime is not None:\n        {change}\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    with pytest.raises(PluginError) as e:
        train_main(
            ["--config", "examples/tiny.yaml", "--num-rollout", "1", "--custom-rm-path", f"{module}.reward",
             "--runs-dir", str(tmp_path / "runs"), "--run-name", "b"]
        )  # fmt: skip
    said = str(e.value)
    assert said.startswith("step 1: sample ") and says in said and "\n" not in said
    assert f"(--custom-rm-path {module}.reward)" in said

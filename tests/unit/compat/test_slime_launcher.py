"""slime's Python launchers on vime: a `python launcher.py` written as slime's tests/test_*.py are
(`import slime.utils.external_utils.command_utils as U`, prepare() then execute()) starts a vime
run, in a plain interpreter where vime's .pth answers `import slime`; a model that cannot be
downloaded is one line naming the directory to fill."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from vime.compat.utils.external_utils.downloads import download_command

PTH = ROOT / "vime" / "compat" / "vime-slime.pth"

# slime's tests/test_qwen2.5_0.5B_short.py in shape: its flags, the sizes cut for two CPU cores
LAUNCHER = """
import os
import slime.utils.external_utils.command_utils as U

MODEL_NAME = "Qwen2.5-0.5B-Instruct"
MODEL_TYPE = "qwen2.5-0.5B"
ROOT = os.environ["LAUNCH_ROOT"]


def prepare():
    U.exec_command(f"mkdir -p {ROOT}/models {ROOT}/datasets")
    U.exec_command(f"hf download Qwen/{MODEL_NAME} --local-dir {ROOT}/models/{MODEL_NAME}")
    U.convert_checkpoint(model_name=MODEL_NAME, megatron_model_type=MODEL_TYPE, num_gpus_per_node=1, dir_dst=f"{ROOT}/models")


def execute():
    ckpt_args = f"--hf-checkpoint {ROOT}/models/{MODEL_NAME}/ --ref-load {ROOT}/models/{MODEL_NAME}_torch_dist "
    rollout_args = (
        f"--prompt-data {os.environ['DATA']} --input-key input --label-key label --rollout-shuffle "
        "--rm-type deepscaler --num-rollout 1 --rollout-batch-size 2 --n-samples-per-prompt 2 "
        "--rollout-max-response-len 8 --rollout-temperature 0.8 --global-batch-size 4 "
    )
    grpo_args = "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --eps-clip 0.2 "
    misc_args = f"--attention-dropout 0.0 --actor-num-nodes 1 --actor-num-gpus-per-node 1 --runs-dir {ROOT}/runs --run-name short "
    U.execute_train(
        train_args=f"{ckpt_args} {rollout_args} {grpo_args} {U.get_default_wandb_args(__file__)} {misc_args}",
        num_gpus_per_node=1,
        megatron_model_type=MODEL_TYPE,
        extra_env_vars={"LAUNCHED_BY": "slime"},
    )


if __name__ == "__main__":
    prepare()
    execute()
"""


def launch(script: Path, env: dict[str, str], site_dir: Path) -> subprocess.CompletedProcess:
    """`python script` in a fresh interpreter whose site directory holds vime's .pth."""
    boot = (
        f"import runpy, site; site.addsitedir({str(site_dir)!r}); runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", boot], cwd=script.parent, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    out = tmp_path / "site"
    out.mkdir()
    shutil.copy(PTH, out / PTH.name)
    return out


def test_a_slime_launcher_prepares_and_starts_a_vime_run(tmp_path, site_dir, addition_data):
    from vime.models import resolve_model

    (tmp_path / "models").mkdir()
    shutil.copytree(resolve_model("tiny"), tmp_path / "models" / "Qwen2.5-0.5B-Instruct")  # "downloaded" before
    script = tmp_path / "test_qwen_short.py"
    script.write_text(LAUNCHER)
    out = launch(script, {"LAUNCH_ROOT": str(tmp_path), "DATA": str(addition_data[0])}, site_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert f"{tmp_path}/models/Qwen2.5-0.5B-Instruct holds files already: using them" in said
    assert "convert_checkpoint Qwen2.5-0.5B-Instruct: vime trains the HF checkpoint" in said
    assert "EXEC: vime train --hf-checkpoint" in said and "scripts/models/qwen2.5-0.5B.sh is not sourced" in said
    rows = [json.loads(x) for x in (tmp_path / "runs" / "short" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 1
    config = (tmp_path / "runs" / "short" / "config.yaml").read_text()
    assert "rm_type: deepscaler" in config


def test_a_model_that_cannot_be_downloaded_is_one_line_naming_the_directory(tmp_path, site_dir):
    script = tmp_path / "fetch.py"
    script.write_text(
        "import slime.utils.misc as U\n"
        f"U.exec_command('hf download Qwen/Qwen3-4B --local-dir {tmp_path}/models/Qwen3-4B')\n"
    )
    out = launch(script, {}, site_dir)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: hf download Qwen/Qwen3-4B failed (LocalEntryNotFoundError): offline, put the model's files in "
        f"{tmp_path}/models/Qwen3-4B (an HF directory) and run the launcher again"
    )


def test_a_failed_run_ends_the_launcher_with_its_code_and_its_line(tmp_path, site_dir):
    script = tmp_path / "bad.py"
    script.write_text(
        "import slime.utils.external_utils.command_utils as U\n"
        "U.execute_train(train_args='--hf-checkpoint tiny --no-such-flag 1', num_gpus_per_node=1, megatron_model_type=None)\n"
    )
    out = launch(script, {}, site_dir)
    assert out.returncode == 2 and "--no-such-flag" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "cmd",
    [
        "mkdir -p /x",
        "hf download a/b",
        "hf download a/b --local-dir d --revision main",
        "hf download a/b --local-dir d && ls",
    ],
)
def test_only_a_plain_download_is_vimes_the_rest_goes_to_the_shell(cmd):
    assert download_command(cmd) is False

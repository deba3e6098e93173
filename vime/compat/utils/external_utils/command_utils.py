"""slime's `slime.utils.external_utils.command_utils`, what its Python launchers call, with vime's
meaning (slime's tests/test_qwen2.5_0.5B_short.py, examples/geo3k_vlm_multi_turn/run_*.py):

    prepare():  U.exec_command("mkdir -p ..."); U.exec_command("hf download Qwen/X --local-dir D")
                U.hf_download_dataset("org/name"); U.convert_checkpoint(model_name=..., ...)
    execute():  U.execute_train(train_args="--hf-checkpoint ... --rm-type ...", num_gpus_per_node=N,
                                megatron_model_type="qwen2.5-0.5B")

* `execute_train` starts vime's `train.py` (or `train_async.py`, as `train_script` names) on
  `train_args` in a process of its own, with `extra_env_vars`; vime starts its own processes, so
  there is no Ray head to start, no `ray job submit` and nothing killed first (slime pkills
  sglang, ray and redis). `megatron_model_type`'s `scripts/models/<type>.sh` is not sourced:
  vime reads the model's shape from `--hf-checkpoint`. A run that fails ends the launcher with the
  run's exit code, its one-line error above.
* `convert_checkpoint` makes nothing: vime trains and refers to the HF checkpoint itself (a
  `--ref-load` of the `_torch_dist` directory slime would have made is named at start-up, and
  `--kl-loss-coef 0` reads none).
* Downloads (`hf download`, `hf_download_dataset`): a local directory that holds files is used,
  else huggingface_hub fetches it; offline, one line names the directory to fill (downloads.py).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vime.compat.utils.external_utils.downloads import hf_download
from vime.compat.utils.misc import exec_command

__all__ = [
    "GENERATION_HARDWARE",
    "NUM_GPUS_OF_HARDWARE",
    "ExecuteTrainConfig",
    "check_has_nvlink",
    "convert_checkpoint",
    "create_run_id",
    "exec_command",
    "execute_train",
    "fp8_cast_bf16",
    "get_bool_env_var",
    "get_default_wandb_args",
    "get_env_enable_infinite_run",
    "hf_download_dataset",
    "rsync_simple",
    "save_to_temp_file",
]

# the vime command of each of slime's entry points
ENTRIES = {"train.py": "train", "train_async.py": "train-async"}
NUM_GPUS_OF_HARDWARE = {"H100": 8, "GB200": 4, "GB300": 4}
GENERATION_HARDWARE = {"H100": "Hopper", "GB200": "Blackwell", "GB300": "Blackwell"}


@dataclass
class ExecuteTrainConfig:
    """slime's launch options; a launcher may extend it."""

    cuda_core_dump: bool = False  # no effect: slime's CUDA core-dump variables are for its Ray job
    num_nodes: int = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))  # no effect: train_args place the run
    extra_env_vars: str = ""  # JSON, or `K=V K2=V2`, added to the run's environment


def execute_train(
    train_args: str,
    num_gpus_per_node: int,
    megatron_model_type: str | None,
    train_script: str = "train.py",
    before_ray_job_submit: Callable[[], object] | None = None,
    extra_env_vars: dict[str, str] | None = None,
    config: ExecuteTrainConfig | None = None,
) -> None:
    """vime's `train_script` run on `train_args` (see the module's docstring); `num_gpus_per_node`
    was slime's Ray head's GPU count: vime's run places itself by the flags in `train_args`."""
    command = ENTRIES.get(Path(train_script).name)
    if command is None:
        raise SystemExit(
            f"error: execute_train(train_script={train_script!r}): vime runs train.py or train_async.py; give one of them"
        )
    if before_ray_job_submit is not None:
        before_ray_job_submit()
    if not get_bool_env_var("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "1"):
        print("execute_train: SLIME_SCRIPT_ENABLE_RAY_SUBMIT is off: no run started", flush=True)
        return
    if megatron_model_type is not None:
        print(
            f"execute_train: vime reads the model's shape from --hf-checkpoint; scripts/models/{megatron_model_type}.sh "
            "is not sourced",
            flush=True,
        )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(extra_env_vars or {})
    env.update(_parse_extra_env_vars((config or ExecuteTrainConfig()).extra_env_vars))
    argv = [sys.executable, "-m", "vime", command, *shlex.split(train_args)]
    print(f"EXEC: vime {command} {train_args.strip()}", flush=True)
    code = subprocess.run(argv, env=env).returncode
    if code != 0:
        raise SystemExit(code)  # the run said why on its last line


def _parse_extra_env_vars(text: str) -> dict[str, str]:
    """slime's `extra_env_vars` string: a JSON object, or `K=V` words."""
    if not text.strip():
        return {}
    try:
        return {k: str(v) for k, v in json.loads(text).items()}
    except (ValueError, AttributeError):
        return dict(item.split("=", 1) for item in text.split() if "=" in item)


def convert_checkpoint(
    model_name: str,
    megatron_model_type: str,
    num_gpus_per_node: int,
    multinode: bool = False,
    extra_args: str = "",
    dir_dst: str = "/root",
    hf_checkpoint: str | None = None,
) -> None:
    """slime makes `{dir_dst}/{model_name}_torch_dist` for Megatron from the HF checkpoint; vime
    trains the HF checkpoint itself, so nothing is made."""
    print(
        f"convert_checkpoint {model_name}: vime trains the HF checkpoint ({hf_checkpoint or f'/root/models/{model_name}'}) "
        f"itself: no {dir_dst}/{model_name}_torch_dist is made",
        flush=True,
    )


def hf_download_dataset(full_name: str) -> None:
    """The data set `org/name` in /root/datasets/name, as slime keeps it."""
    _, name = full_name.split("/")
    hf_download(full_name, f"/root/datasets/{name}", repo_type="dataset")


def rsync_simple(path_src: str, path_dst: str) -> None:
    exec_command(f"mkdir -p {path_dst} && rsync -a --info=progress2 {path_src}/ {path_dst}")


def fp8_cast_bf16(path_src: str, path_dst: str) -> None:
    """slime's tools/fp8_cast_bf16.py, which vime does not have."""
    raise SystemExit(
        f"error: fp8_cast_bf16 {path_src}: vime has no FP8-to-BF16 cast of a checkpoint; give a BF16 HF checkpoint "
        f"at {path_dst}"
    )


def check_has_nvlink() -> bool:
    """Whether nvidia-smi reports NVLink between the GPUs (False without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(word.startswith("NV") and word[2:].isdigit() for word in out.split())


def get_default_wandb_args(test_file: str, run_name_prefix: str | None = None, run_id: str | None = None) -> str:
    """slime's W&B flags for a launcher (vime takes them: --use-wandb, ...); none without WANDB_API_KEY."""
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        print("Skip wandb configuration since WANDB_API_KEY is not found")
        return ""
    path = Path(test_file)
    test_name = path.stem if len(path.stem) >= 6 else f"{path.parent.name}_{path.stem}"
    name = run_id or create_run_id()
    if (commit := os.environ.get("GITHUB_COMMIT_NAME")) is not None:
        name += f"_{commit}"
    if run_name_prefix is not None:
        name = f"{run_name_prefix}_{name}"
    return (
        f"--use-wandb --wandb-project slime-{test_name} --wandb-group {name} --wandb-key '{key}' "
        "--disable-wandb-random-suffix "
    )


def create_run_id() -> str:
    now = datetime.datetime.now(datetime.UTC)
    return now.strftime("%y%m%d-%H%M%S") + f"-{random.Random().randint(0, 999):03d}"


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """SGLang's reading: true/1 or false/0; anything else is false, said once."""
    value = os.getenv(name, default).lower()
    if value not in ("true", "1", "false", "0"):
        print(f"get_bool_env_var({name}) see non-understandable value={value} and treat as false")
    return value in ("true", "1")


def get_env_enable_infinite_run() -> bool:
    return get_bool_env_var("SLIME_TEST_ENABLE_INFINITE_RUN", "false")


def save_to_temp_file(text: str, ext: str) -> str:
    path = Path(f"/tmp/slime_temp_file_{time.time()}_{random.randrange(0, 10000000)}.{ext}")
    path.write_text(text)
    print(f"Write the following content to {path=}: {text=}")
    return str(path)

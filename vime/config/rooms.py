"""Each room's own settings: frozen dataclasses built from the validated flat `Config` and
reached as `cfg.rollout`, `cfg.algorithm`, `cfg.trainer`, `cfg.placement`, `cfg.eval` and
`cfg.output`, so a room's code names the settings it reads and nothing else.

They are built on access (`Config`'s properties; a few dozen attribute reads), never stored: a
value start-up finds after validation (`load`, `num_rollout`, `model_dir`, `launcher`) goes into
a new config (`Config.derived`), whose rooms hold it. A room that keeps one keeps a snapshot:
take it from the config the run was assembled with (frozen: the trainer is built after preflight).
Each field has its flag's name and type; tests/test_config.py checks that against `Settings`.
Three are declared in their rooms, which sit below the config because it reads their tables
(the objectives, the rm types, the backends), and named here with the others: `AlgorithmConfig`
(vime/algorithms/settings.py), `RolloutConfig` (vime/rollout/settings.py), `PlacementConfig`
(vime/backends/settings.py).
Plug-ins written for slime keep receiving the flat `args`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vime.algorithms.settings import AlgorithmConfig as AlgorithmConfig
from vime.backends.settings import PlacementConfig as PlacementConfig
from vime.rollout.settings import RolloutConfig as RolloutConfig

Room = TypeVar("Room")


def take(room: type[Room], cfg: Any) -> Room:
    """The room's fields read from the flat config (a property such as `steps_per_rollout` too)."""
    return room(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(room)})


@dataclass(frozen=True)
class TrainerConfig:
    """What vime/trainer/ reads: LoRA, the optimizer and its schedule, batches and micro-batches,
    compilation and checkpointing of activations. Besides those: `hf_checkpoint` (the base an
    adapter names), `rollout_temperature` (log-probs are recomputed at the temperature the
    engines sampled at), `rollout_max_response_len` (Dr.GRPO's loss divides by it), `num_rollout`
    and `steps_per_rollout` (the schedule's default horizon)."""

    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list
    exclude_modules: list
    optimizer: str
    lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_warmup_fraction: float | None
    lr_decay_iters: int | None
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    global_batch_size: int | None
    num_steps_per_rollout: int | None
    max_tokens_per_gpu: int
    micro_batch_size: int | None
    gradient_checkpointing: bool
    gradient_checkpointing_layers: int | None
    compile: bool | None
    attention_kernel: str
    logprob_chunk_size: int
    seed: int
    max_bad_steps: int
    hf_checkpoint: str | None
    rollout_temperature: float
    rollout_max_response_len: int
    num_rollout: int | None
    steps_per_rollout: int


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: when, on which sets (`eval_sets`, resolved at validation), and the
    sampling and grading settings a set may override. Besides those: `rm_type` (eval grades as
    training does for `exact`), `model_dir` (a prompt's room in the model's context)."""

    eval_interval: int | None
    eval_prompt_data: list | None
    eval_name: str | None
    eval_config: str | None
    eval_input_key: str | None
    eval_label_key: str | None
    n_samples_per_eval_prompt: int
    eval_temperature: float | None
    eval_top_p: float | None
    eval_top_k: int | None
    eval_rm_type: str | None
    skip_eval_before_train: bool
    eval_max_response_len: int | None
    eval_limit: int | None
    eval_sets: list
    rm_type: str
    model_dir: str | None

    @property
    def rule(self) -> str:
        """The rule held-out answers are graded by: the set's own rm type; else the training
        rm type where it is a rule of its own kind (`exact`: a list in full, on its last line;
        a multiple-choice type: the option letter); else math's (boxed, Answer:, trailing number),
        the held-out metric's reading for every other rm type."""
        from vime.rollout.rewards.grading import BUILTIN_RM_TYPES

        if self.eval_rm_type:
            return self.eval_rm_type
        own = BUILTIN_RM_TYPES.get(self.rm_type)
        return self.rm_type if own is not None and (own.exact or own.choice) else "math"


@dataclass(frozen=True)
class OutputConfig:
    """What a run writes: checkpoints, its directory and name, TensorBoard and W&B, the console.
    Besides those: `run_dir` (where --runs-dir and --run-name put the run)."""

    save: str | None
    save_interval: int | None
    load: str | None
    overwrite_save: bool
    run_name: str | None
    runs_dir: str
    use_tensorboard: bool
    tb_project_name: str | None
    tb_experiment_name: str | None
    use_wandb: bool
    wandb_project: str | None
    wandb_team: str | None
    wandb_group: str | None
    wandb_run_id: str | None
    wandb_mode: str | None
    wandb_key: str | None
    wandb_host: str | None
    wandb_dir: str | None
    quiet: bool
    run_dir: Path

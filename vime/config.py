"""One typed config for every entry point.

Flags keep slime's names (`--rollout-batch-size` ↔ `cfg.rollout_batch_size`), so a slime user's
scripts read naturally. The parser is generated from the dataclass below: a field, its type,
default and help are written once. `--config run.yaml` is applied first; flags given on the
command line win over it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from vime import compat
from vime.algorithms import (
    ADVANTAGES,
    BASE_LOSS,
    POLICY_LOSSES,
    Estimator,
    estimator_help,
    estimator_names,
    estimator_of,
)
from vime.algorithms.sft import SFTLoss
from vime.backends import BACKENDS, TRANSPORTS, Backend
from vime.errors import ConfigError
from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN, MODES, SFT_ROLLOUT_FN

ENTRIES = ("sync", "async", "eval")  # train.py, train_async.py, vime eval

# What each --off-policy-correction sets (the flags are slime's); "none" turns both off.
# tis: slime's --use-tis defaults; icepop: IcePop's band [0.5, 5]; decoupled-ppo: AReaL's
# behaviour-weight cap of 5, nothing below it touched; m2po: M2PO's second-moment trust region
# at the paper's threshold (0.04).
_NO_CORRECTION = {"use_tis": False, "use_rs": False, "m2_threshold": None}
CORRECTIONS: dict[str, dict[str, Any]] = {
    "none": _NO_CORRECTION,
    "tis": {**_NO_CORRECTION, "use_tis": True, "tis_mode": "truncate", "tis_clip": 2.0, "tis_clip_low": 0.0},
    "icepop": {**_NO_CORRECTION, "use_tis": True, "tis_mode": "mask", "tis_clip": 5.0, "tis_clip_low": 0.5},
    "decoupled-ppo": {**_NO_CORRECTION, "use_tis": True, "tis_mode": "mask", "tis_clip": 5.0, "tis_clip_low": 0.0},
    "m2po": {**_NO_CORRECTION, "m2_threshold": 0.04},
}
# the correction auto picks in every mode that can train stale samples
ASYNC_CORRECTION = "tis"


DERIVED, RUNTIME, PASSTHROUGH = "derived", "runtime", "passthrough"  # field groups that are not flags


def _f(
    default: Any,
    help: str,
    choices: tuple | None = None,
    group: str = "",
    nargs: str | None = None,
    sep: str | None = ",",
) -> Any:
    """A field and its flag. `nargs="+"`: the flag takes several values, as slime's does; `sep`:
    a single value of a list flag is split on it (None: kept whole)."""
    meta = {"help": help, "choices": choices, "group": group, "nargs": nargs, "sep": sep}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    # --- model and data ---
    hf_checkpoint: str | None = _f(
        None,
        "HF model directory, a hub id (online only), or 'smollm2' (embedded SmolLM2-135M-Instruct)",
        group="model and data",
    )
    prompt_data: str | None = _f(
        None, "training prompts: JSONL or Parquet, optionally sliced as path@[a:b]", group="model and data"
    )
    input_key: str = _f("input", "key of the prompt (a string or a list of chat messages)", group="model and data")
    label_key: str = _f(
        "label",
        "key of the reference answer (a dotted key reads nested dicts: reward_model.ground_truth)",
        group="model and data",
    )
    label_format: str = _f(
        "text",
        "text (the label as it is), or gsm8k (the answer after the label's last '####', as in GSM8K's answer column)",
        ("text", "gsm8k"),
        group="model and data",
    )
    metadata_key: str = _f("metadata", "key of a per-row dict passed to rewards", group="model and data")
    tool_key: str | None = _f(
        None,
        "key of a per-row list of OpenAI-style tool schemas, passed to the chat template as tools= (with --apply-chat-template)",
        group="model and data",
    )
    apply_chat_template: bool = _f(False, "render prompts with the tokenizer's chat template", group="model and data")
    apply_chat_template_kwargs: dict = _f(
        {}, "JSON dict passed to the chat template, e.g. '{\"enable_thinking\": false}'", group="model and data"
    )
    # --- rollout ---
    rollout_batch_size: int = _f(8, "prompts per rollout step", group="rollout")
    n_samples_per_prompt: int = _f(4, "responses per prompt (the GRPO group size)", group="rollout")
    num_rollout: int | None = _f(None, "rollout steps to run (default: from --num-epoch)", group="rollout")
    num_epoch: int | None = _f(None, "passes over the prompt data when --num-rollout is not given", group="rollout")
    rollout_function_path: str = _f(DEFAULT_ROLLOUT_FN, "dotted path of the rollout function", group="rollout")
    custom_generate_function_path: str | None = _f(
        None, "dotted path of an async per-sample generate(args, sample, sampling_params) -> Sample", group="rollout"
    )
    custom_config_path: str | None = _f(
        None,
        "slime's YAML of settings for custom functions: its keys override the flags (checked as flags are); keys that are no vime setting become attributes of args",
        group="rollout",
    )
    rollout_max_response_len: int = _f(256, "max new tokens per response", group="rollout")
    rollout_temperature: float = _f(1.0, "sampling temperature (0 = greedy)", group="rollout")
    rollout_top_p: float = _f(1.0, "nucleus sampling mass", group="rollout")
    rollout_top_k: int = _f(-1, "top-k sampling (-1 = off)", group="rollout")
    rollout_stop_token_ids: list = _f(
        [],
        "extra token ids that end a response (several values, a JSON list or comma-separated)",
        group="rollout",
        nargs="+",
    )
    rollout_stop: list = _f(
        [],
        "strings that end a response, the string kept (several values, or a JSON list)",
        group="rollout",
        nargs="+",
        sep=None,
    )
    rollout_max_prompt_len: int | None = _f(
        None,
        "leave out prompts longer than this many tokens (counted in rollout/skipped_prompts), as slime filters its data",
        group="rollout",
    )
    rollout_max_context_len: int | None = _f(
        None,
        "prompt + response tokens at most: a response stops where its sample reaches this length (default: the model's context)",
        group="rollout",
    )
    # --- debugging one side ---
    save_debug_rollout_data: str | None = _f(
        None,
        "write every rollout the trainer receives to this path, formatted with {rollout_id} (e.g. dbg/{rollout_id}.pt)",
        group="debug",
    )
    load_debug_rollout_data: str | None = _f(
        None,
        "train on rollouts saved by --save-debug-rollout-data (same template) instead of generating; turns on --debug-train-only",
        group="debug",
    )
    debug_train_only: bool = _f(
        False,
        "start no engine: train on --load-debug-rollout-data (or the SFT rollout function's conversations), push nothing, evaluate nothing",
        group="debug",
    )
    debug_rollout_only: bool = _f(
        False,
        "start no trainer: the engines generate with the starting weights and rewards score; metrics and saved rollouts are written",
        group="debug",
    )
    # --- multi-turn tool use ---
    tools: list = _f(
        [],
        "tools the model may call: calculator, python, or module:name of a vime.rollout.tools.Tool; "
        "turns on the built-in multi-turn generate (vime.rollout.multi_turn) and shows the tools' schemas to the chat template",
        group="tools",
        nargs="+",
    )
    max_turns: int = _f(
        4, "model turns per sample at most with --tools (a tool's answer starts the next turn)", group="tools"
    )
    tool_timeout: float = _f(
        10.0, "seconds a tool call may take; a slower one ends its turn with an error the model reads", group="tools"
    )
    tool_max_output_chars: int = _f(
        2000,
        "characters of a tool's answer kept in the conversation; a longer one is cut there and counted as an error",
        group="tools",
    )
    dynamic_sampling_filter_path: str | None = _f(
        None,
        "DAPO's dynamic sampling: dotted path of a filter fn(args, samples) -> bool or DynamicFilterOutput that judges each "
        "scored group; a dropped group is never trained (counted in rollout/dynamic_filter/*) and more prompts are generated "
        "until the batch is full of kept ones, in every mode. Built in: vime.rollout.filters.check_reward_nonzero_std "
        "(rewards not all equal) and ..._with_fallback; slime's paths to them are accepted",
        group="rollout",
    )
    over_sampling_batch_size: int | None = _f(
        None,
        "with --dynamic-sampling-filter-path, prompt groups started at once whenever the groups kept and in flight cannot fill "
        "the batch (at least --rollout-batch-size; default: it); groups still in flight when the batch is full are aborted and "
        "generated again later. The fully-async worker keeps --rollout-concurrency groups in flight instead",
        group="rollout",
    )
    rollout_shuffle: bool = _f(False, "shuffle prompts every epoch (seeded by --rollout-seed)", group="rollout")
    rollout_seed: int = _f(42, "seed of prompt order and sampling", group="rollout")
    skip_overlong_prompts: bool = _f(
        False,
        "drop prompts too long for the model's context (counted in rollout/skipped_prompts) instead of refusing the data at start-up",
        group="rollout",
    )
    # --- async training ---
    rollout_concurrency: int | None = _f(
        None, "fully-async: prompt groups in flight at once (default: 2 × --rollout-batch-size)", group="async"
    )
    max_staleness: int | None = _f(
        None,
        "train on tokens at most K optimizer steps older than the weights that train them; the fully-async worker then never waits for training (decoupled); 0 trains exactly what sync trains",
        group="async",
    )
    partial_rollout: bool = _f(
        False,
        "slime's name for --update-in-flight resume: abort in-flight requests at each push and resume them from their tokens",
        group="async",
    )
    update_in_flight: str = _f(
        "keep",
        "fully-async and decoupled: what a weight push does to the groups being generated. keep: paused in place, they "
        "go on with the new weights (their earlier tokens stay the old ones'); abort: aborted and generated again from "
        "the start with the new weights (the seed system's worker); resume: aborted and continued from their tokens "
        "(--partial-rollout)",
        ("keep", "abort", "resume"),
        group="async",
    )
    # --- rewards ---
    rm_type: str = _f(
        "math",
        "built-in reward: math (1/0), exact (1/0, the normalized answer string must equal the label: lists, words), dapo (1/-1), boxed_math, math_shaped (1, or up to 0.5 for a wrong number by its closeness), reasoning_gym (the task's own scorer, for rows of `vime data --task rg:<name>`), remote_rm (a reward model at --rm-url)",
        group="rewards",
    )
    rm_url: str | None = _f(
        None,
        "--rm-type remote_rm: the reward model's URL; each sample is POSTed as JSON {prompt, response, label} "
        "(slime's body) and the JSON answer is its reward; retried while --reward-timeout lasts",
        group="rewards",
    )
    custom_rm_path: str | None = _f(
        None, "dotted path of a reward fn(args, sample) -> float, sync or async", group="rewards"
    )
    reward_timeout: float = _f(10.0, "seconds before a reward call scores 0", group="rewards")
    reward_key: str | None = _f(
        None,
        "a reward function that returns a dict is read at this key (default: 'score'); its other numeric values are logged as rollout/reward_<key>",
        group="rewards",
    )
    # --- algorithm ---
    advantage_estimator: str = _f(
        "grpo",
        estimator_help(),
        estimator_names(),
        group="algorithm",
    )
    custom_advantage_function_path: str | None = _f(
        None,
        "dotted path of fn(args, groups, rewards [groups × n]) -> advantages [groups × n], one per sample, in place "
        "of the estimator's (whitening still applies after it)",
        group="algorithm",
    )
    normalize_advantages: bool = _f(
        False,
        "whiten the advantages over the batch's loss tokens (zero mean, unit variance); REINFORCE++ always does",
        group="algorithm",
    )
    gamma: float = _f(
        1.0,
        "REINFORCE++'s discount: a token's return is the reward times gamma^(its distance to the last loss token), "
        "so the advantage is per token below 1",
        group="algorithm",
    )
    loss_type: str = _f(
        "policy_loss",
        "policy_loss (the estimator's); custom_loss: the per-token policy term of --custom-loss-function-path; "
        "sft_loss: the negative log-likelihood of the loss tokens (SFT, with --rollout-function-path "
        "vime.rollout.sft_rollout.generate_rollout)",
        ("policy_loss", "custom_loss", "sft_loss"),
        group="algorithm",
    )
    loss_mask_type: str = _f(
        "qwen",
        "SFT: which of a conversation's tokens are trained. vime renders the whole conversation with the model's "
        "chat template and trains every assistant turn (its text and the tokens that close it) for qwen, qwen3 and "
        "qwen3_5 alike; distill_qwen (the last message as raw text) is not offered",
        ("qwen", "qwen3", "qwen3_5", "distill_qwen"),
        group="algorithm",
    )
    disable_compute_advantages_and_returns: bool = _f(
        False,
        "slime's switch for losses that need no advantages: accepted with --loss-type sft_loss, which computes none",
        group="algorithm",
    )
    custom_loss_function_path: str | None = _f(
        None,
        "with --loss-type custom_loss: dotted path of fn(args, *, log_probs, old_log_probs, advantages, loss_mask, "
        "rollout_log_probs, seq_ids) -> per-token loss (or (loss, {name: per-token tensor})), flat over a micro-batch's "
        "tokens; vime aggregates it as its own (so micro-batches add up) and adds entropy and KL terms",
        group="algorithm",
    )
    use_opsm: bool = _f(
        False,
        "off-policy sequence masking: leave out the tokens of negative-advantage sequences whose mean log π_old − log π "
        "exceeds --opsm-delta (the policy already moved away from them)",
        group="algorithm",
    )
    opsm_delta: float = _f(1e-4, "the drift --use-opsm tolerates", group="algorithm")
    disable_grpo_std_normalization: bool = _f(
        False, "do not divide advantages by the group std (Dr.GRPO)", group="algorithm"
    )
    eps_clip: float = _f(0.2, "PPO clip range below 1", group="algorithm")
    eps_clip_high: float | None = _f(None, "PPO clip range above 1 (default: --eps-clip)", group="algorithm")
    calculate_per_token_loss: bool = _f(
        True,
        "the policy loss is a mean over all of the step's loss tokens (default, as DAPO argues: every token weighs the same whatever its response's length, so a long wrong answer is not penalized less per token than a short one; every vime figure was measured so); --no-calculate-per-token-loss is slime's default: the mean over samples of each sample's token mean",
        group="algorithm",
    )
    eps_clip_c: float | None = _f(
        None,
        "dual-clip PPO: a token with a negative advantage A loses at most -A·c (c > 1), so one token whose ratio exploded cannot set the step (default: off)",
        group="algorithm",
    )
    kl_loss_coef: float = _f(
        0.0, "weight of the KL loss to a frozen reference (0 = no reference model)", group="algorithm"
    )
    use_kl_loss: bool = _f(
        False,
        "slime's switch for the KL loss; vime applies any nonzero --kl-loss-coef with or without it, and with a coefficient of 0 loads no reference model",
        group="algorithm",
    )
    kl_loss_type: str = _f(
        "low_var_kl",
        "KL estimator: k1 (log-ratio), k2 (half its square), k3 (exp(-r) - 1 + r), low_var_kl (k3 clamped to [-10, 10])",
        ("low_var_kl", "k1", "k2", "k3"),
        group="algorithm",
    )
    use_unbiased_kl: bool = _f(
        False,
        "weight each token's KL by the ratio of the current to the old policy (the unbiased estimate of the KL under the current policy)",
        group="algorithm",
    )
    ref_load: str | None = _f(
        None,
        "the reference model of the KL loss: an HF model directory (default: --hf-checkpoint); read only when --kl-loss-coef > 0",
        group="algorithm",
    )
    use_opd: bool = _f(
        False,
        "on-policy distillation: a teacher scores every token of the student's responses, and "
        "--opd-kl-coef x (log p_teacher - log p_student) is added to each token's advantage",
        group="algorithm",
    )
    opd_type: str | None = _f(
        None,
        "where the teacher runs: megatron (slime's name; in vime the trainer loads it from --opd-teacher-load); "
        "sglang and vllm (a teacher served by an engine) are not in vime yet",
        ("megatron", "sglang", "vllm"),
        group="algorithm",
    )
    opd_kl_coef: float = _f(1.0, "weight of the per-token reverse-KL advantage of --use-opd", group="algorithm")
    opd_teacher_load: str | None = _f(
        None,
        "the OPD teacher: an HF model directory, a vime --save directory (its newest checkpoint) or one <step>/ "
        "checkpoint of it; same vocabulary as the student",
        group="algorithm",
    )
    opd_teacher_ckpt_step: int | None = _f(
        None, "the step of the --opd-teacher-load --save directory to load (default: its newest)", group="algorithm"
    )
    entropy_coef: float = _f(0.0, "entropy bonus weight (the entropy is always logged)", group="algorithm")
    use_rollout_logprobs: bool = _f(
        False,
        "take the PPO ratio against the engine's log-probs (the behaviour policy) instead of the trainer's current weights: coupled PPO, no recompute",
        group="algorithm",
    )
    off_policy_correction: str = _f(
        "auto",
        "how samples from older weights (or other kernels) are corrected: auto = none in sync and at --max-staleness 0, "
        f"else {ASYNC_CORRECTION} (chosen by a sweep over seeds: bench/RESULTS.md); none; "
        "tis = --use-tis, weight π_old/π_rollout clamped to [0, 2]; icepop = weight kept in [0.5, 5], tokens outside it "
        "masked; decoupled-ppo = AReaL's, weight kept up to 5, tokens above it masked; m2po = --m2-threshold 0.04, the "
        "tokens of largest (log π_old/π_rollout)² masked until the rest's mean is at most 0.04; custom = exactly what "
        "--use-tis/--use-rs/--m2-threshold and their bounds say (auto becomes custom when one is given)",
        ("auto", "none", "tis", "icepop", "decoupled-ppo", "m2po", "custom"),
        group="algorithm",
    )
    use_tis: bool = _f(
        False,
        "weight each token's loss by π_old/π_rollout (truncated importance sampling; with stale samples this is decoupled PPO)",
        group="algorithm",
    )
    tis_mode: str = _f(
        "truncate",
        "truncate: clamp the TIS weight to [--tis-clip-low, --tis-clip]; mask: weight 0 outside that band (IcePop)",
        ("truncate", "mask"),
        group="algorithm",
    )
    tis_level: str = _f(
        "token",
        "what one TIS weight covers: each token (token), or every token of a sequence alike, by the product of its "
        "tokens' ratios (sequence) or their geometric mean (geometric)",
        ("token", "sequence", "geometric"),
        group="algorithm",
    )
    custom_tis_function_path: str | None = _f(
        None,
        "dotted path of slime's TIS hook fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
        "total_lengths, response_lengths, **kw) -> (pg_loss, loss_masks, metrics), applied to each micro-batch after "
        "the built-in corrections (total_lengths is None: vime has no context parallelism)",
        group="algorithm",
    )
    tis_clip: float = _f(2.0, "upper bound of the TIS weight", group="algorithm")
    tis_clip_low: float = _f(0.0, "lower bound of the TIS weight", group="algorithm")
    use_rs: bool = _f(
        False,
        "rejection (masked importance sampling): drop tokens or sequences whose π_old/π_rollout leaves [--rs-lower-bound, --rs-upper-bound]",
        group="algorithm",
    )
    rs_level: str = _f(
        "token",
        "what --use-rs drops: token, or sequence (product of its token ratios) or geometric (their geometric mean) for whole sequences",
        ("token", "sequence", "geometric"),
        group="algorithm",
    )
    rs_lower_bound: float = _f(0.5, "lower bound of the ratio --use-rs keeps", group="algorithm")
    rs_upper_bound: float = _f(2.0, "upper bound of the ratio --use-rs keeps", group="algorithm")
    rs_veto_threshold: float | None = _f(
        None,
        "drop a whole sequence in which any loss token's π_old/π_rollout is below this (e.g. 1e-4): a token the "
        "trainer finds far less likely than the engine did marks a numerical failure, not staleness",
        group="algorithm",
    )
    m2_threshold: float | None = _f(
        None,
        "M2PO: mask the tokens of largest (log π_old/π_rollout)² until the rest's mean is at most this (the paper's 0.04); "
        "a trust region on how far the weights moved since sampling that keeps all but the outliers",
        group="algorithm",
    )
    # --- LoRA ---
    lora_rank: int = _f(
        0,
        "train LoRA adapters of this rank on the target layers, the base frozen (0 = full fine-tuning); pushes and "
        "checkpoints carry the merged weights, checkpoints also the adapter in PEFT's layout (adapter/)",
        group="lora",
    )
    lora_alpha: float = _f(16.0, "LoRA's alpha: the adapter's update is scaled by alpha / rank", group="lora")
    lora_dropout: float = _f(0.0, "dropout on the adapters' input while training", group="lora")
    target_modules: list = _f(
        ["all-linear"],
        "layers that get adapters, by their names' last parts (q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj), or all-linear (every linear layer but the LM head)",
        group="lora",
        nargs="+",
    )
    exclude_modules: list = _f(
        [], "layers left without adapters, by last part or whole dotted name", group="lora", nargs="+"
    )
    # --- optimizer ---
    optimizer: str = _f(
        "adam",
        "adam (AdamW: Megatron's adam, weight decay decoupled) or sgd (with --sgd-momentum)",
        ("adam", "sgd"),
        group="optimizer",
    )
    lr: float = _f(1e-6, "peak learning rate", group="optimizer")
    lr_decay_style: str = _f(
        "constant",
        "learning rate after warm-up: constant, or decayed to --min-lr over --lr-decay-iters, linearly or on a cosine",
        ("constant", "linear", "cosine"),
        group="optimizer",
    )
    lr_warmup_iters: int = _f(
        0, "optimizer steps of linear warm-up from 0 to --lr (step 0 runs at 0, as in Megatron)", group="optimizer"
    )
    lr_warmup_fraction: float | None = _f(
        None,
        "warm-up as a share of the decay's optimizer steps (Megatron's; slime's SFT scripts give 0.1): instead of --lr-warmup-iters",
        group="optimizer",
    )
    lr_decay_iters: int | None = _f(
        None,
        "optimizer steps over which the learning rate decays, warm-up included (default: every optimizer step of the run)",
        group="optimizer",
    )
    min_lr: float = _f(0.0, "learning rate at the end of the decay", group="optimizer")
    weight_decay: float = _f(
        0.0,
        "weight decay of the weight matrices, not of biases and norm weights, as in Megatron (decoupled with adam, an L2 term with sgd)",
        group="optimizer",
    )
    adam_beta1: float = _f(0.9, "AdamW beta1", group="optimizer")
    adam_beta2: float = _f(0.98, "AdamW beta2", group="optimizer")
    adam_eps: float = _f(1e-8, "AdamW epsilon", group="optimizer")
    sgd_momentum: float = _f(0.9, "momentum of --optimizer sgd", group="optimizer")
    clip_grad: float = _f(1.0, "gradient norm clip", group="optimizer")
    global_batch_size: int | None = _f(
        None, "samples per optimizer step (default: one step per rollout)", group="optimizer"
    )
    num_steps_per_rollout: int | None = _f(
        None,
        "optimizer steps per rollout: sets --global-batch-size to the rollout's samples divided by it",
        group="optimizer",
    )
    max_tokens_per_gpu: int = _f(4096, "micro-batch token budget", group="optimizer")
    micro_batch_size: int | None = _f(
        None,
        "samples per micro-batch at most, besides the --max-tokens-per-gpu budget (the gradient is the same for any split)",
        group="optimizer",
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward", group="optimizer")
    gradient_checkpointing_layers: int | None = _f(
        None,
        "with --gradient-checkpointing: recompute only the first N decoder layers (default: all of them)",
        group="optimizer",
    )
    compile: bool | None = _f(
        None,
        "torch.compile each decoder layer of the trainer's model: on by default when the trainer is on CUDA. One compile serves every layer; micro-batches are padded up to one of 16 sizes, all compiled in a warm-up before step 1, so nothing compiles mid-run (speed: bench/RESULTS.md)",
        group="optimizer",
    )
    logprob_chunk_size: int = _f(
        4096,
        "tokens per chunk when log-probs are computed from hidden states: caps the logits memory at chunk x vocabulary (bf16: 2 bytes each); smaller chunks are slower (bench/RESULTS.md)",
        group="optimizer",
    )
    seed: int = _f(1234, "trainer seed", group="optimizer")
    max_bad_steps: int = _f(
        3,
        "stop the run after this many steps in a row whose rewards, advantages, loss or gradient norm were not finite (each such optimizer step is skipped)",
        group="optimizer",
    )
    # --- placement and engines ---
    colocate: bool = _f(
        False, "trainer and engine share devices (engine releases memory while training)", group="placement"
    )
    actor_num_nodes: int = _f(1, "trainer nodes", group="placement")
    actor_num_gpus_per_node: int = _f(1, "trainer GPUs per node", group="placement")
    rollout_num_gpus: int | None = _f(None, "GPUs for rollout engines (default: 1 engine)", group="placement")
    rollout_num_gpus_per_engine: int = _f(1, "GPUs per engine (vLLM's tensor parallel size)", group="placement")
    rollout_num_engines: int | None = _f(
        None,
        "engines to launch (default: --rollout-num-gpus / --rollout-num-gpus-per-engine on GPUs, 1 on CPU)",
        group="placement",
    )
    rollout_backend: str = _f(
        "vime",
        "rollout engine: " + "; ".join(f"{b.name}, {b.what}" for b in BACKENDS.values()),
        tuple(BACKENDS),
        group="placement",
    )
    rollout_engine_urls: list = _f(
        [], "use running engines at these URLs instead of launching (JSON list or comma-separated)", group="placement"
    )
    device: str = _f("auto", "trainer device: auto, cpu, cuda", ("auto", "cpu", "cuda"), group="placement")
    launcher: str = _f(
        "auto",
        "where launched engines and trainer ranks 1..N-1 run: local (processes on this machine) or ray (actors the "
        "Ray cluster places, one placement-group bundle each, on any of its nodes; the cluster of RAY_ADDRESS, or "
        "the job's). Trainer rank 0 is the run's own process either way. auto: ray inside a Ray job whose cluster "
        "has more than one node (when the engines can be placed there), else local",
        ("auto", "local", "ray"),
        group="placement",
    )
    engine_max_num_seqs: int = _f(256, "max sequences the engine runs at once", group="placement")
    engine_num_kv_blocks: int | None = _f(
        None, "KV-cache blocks per engine (default: engine's choice)", group="placement"
    )
    update_weights_interval: int = _f(1, "push weights to the engines every K steps", group="placement")
    weight_transport: str = _f(
        "auto",
        "how weights reach engines; auto picks per engine: cuda_ipc on the trainer's GPU, nccl on another GPU, shm for a CPU engine here, gloo otherwise",
        TRANSPORTS,
        group="placement",
    )
    update_weight_buffer_size: int = _f(
        512 * 1024**2, "bytes per bucket when weights are gathered and broadcast", group="placement"
    )
    update_weights_timeout: float = _f(
        120.0,
        "seconds a weight push, or joining the weight group, may take before the run stops with the engine's URL",
        group="placement",
    )
    rollout_health_check_interval: float = _f(
        10.0,
        "seconds between /health probes of an engine while requests wait on it; 0: no probes (a request then waits up to its own 600 s timeout)",
        group="placement",
    )
    rollout_health_check_timeout: float = _f(
        30.0,
        "seconds a probe waits: an engine silent this long is gone, its requests go to the other engines (it is restarted if the run launched it), or the run stops in one line when none is left; also the most an engine may take to answer a pause, continue or abort, past which it is gone too",
        group="placement",
    )
    check_weight_push: bool = _f(
        True,
        "after every push, compare a checksum of each weight the engines got with the trainer's; a mismatch stops the run",
        group="placement",
    )
    update_weights_master_address: str | None = _f(
        None,
        "an address of the trainer's machine that engines on other hosts can reach (nccl/gloo rendezvous); default: loopback, which suffices while every engine runs here",
        group="placement",
    )
    actor_num_procs: int = _f(
        1, "CPU only: trainer processes (gloo), to run multi-rank training without GPUs", group="placement"
    )
    api_key: str | None = _f(
        None,
        "token of engines given by --rollout-engine-urls that were started with --api-key (sent as Authorization: Bearer; default $VIME_API_KEY); engines vime starts get a fresh one per run",
        group="placement",
    )
    # --- evaluation, checkpoints, logging ---
    eval_interval: int | None = _f(
        None, "evaluate every K steps (and before the first and after the last)", group="eval and output"
    )
    eval_prompt_data: list | None = _f(
        None,
        "held-out prompts (JSONL/Parquet, path@[a:b]): PATH, or slime's NAME PATH pairs, one pair per set (NAME PATH NAME PATH ...)",
        group="eval and output",
        nargs="+",
        sep=None,
    )
    eval_name: str | None = _f(None, "name of a held-out set given as a lone PATH", group="eval and output")
    eval_config: str | None = _f(
        None,
        "slime's eval YAML: several held-out sets, each with its own limit, sampling and rm type (docs/slime-flags.md); instead of --eval-prompt-data",
        group="eval and output",
    )
    eval_input_key: str | None = _f(None, "key of the eval prompt (default: --input-key)", group="eval and output")
    eval_label_key: str | None = _f(None, "key of the eval answer (default: --label-key)", group="eval and output")
    n_samples_per_eval_prompt: int = _f(1, "responses per eval prompt (greedy when 1)", group="eval and output")
    eval_temperature: float | None = _f(
        None,
        "eval sampling temperature (default: 0, greedy, with one sample per prompt; --rollout-temperature with more)",
        group="eval and output",
    )
    eval_top_p: float | None = _f(
        None, "eval nucleus mass (default: 1 when greedy, --rollout-top-p otherwise)", group="eval and output"
    )
    eval_top_k: int | None = _f(
        None, "eval top-k, -1 or 0 off (default: off when greedy, --rollout-top-k otherwise)", group="eval and output"
    )
    eval_rm_type: str | None = _f(
        None,
        "grade eval by this built-in rm type's rule (its acc) (default: math's answer reading, exact's with --rm-type exact)",
        group="eval and output",
    )
    skip_eval_before_train: bool = _f(
        False, "with --eval-interval: no evaluation before the first step", group="eval and output"
    )
    eval_max_response_len: int | None = _f(
        None, "max new tokens in eval (default: --rollout-max-response-len)", group="eval and output"
    )
    eval_limit: int | None = _f(None, "evaluate on the first N eval prompts only", group="eval and output")
    save: str | None = _f(None, "checkpoint directory", group="eval and output")
    save_interval: int | None = _f(None, "save every K steps (and at the end)", group="eval and output")
    load: str | None = _f(
        None,
        "resume from this checkpoint directory (the newest intact step inside it), or from one <step>/ directory of it",
        group="eval and output",
    )
    overwrite_save: bool = _f(
        False,
        "let --save name a directory that already holds checkpoints (another run's, or ones newer than the step "
        "--load resumes): each is replaced when this run saves the same step, the others stay, and a later --load "
        "resumes from the newest of all. Without it such a run is refused at start-up",
        group="eval and output",
    )
    run_name: str | None = _f(None, "run name (default: timestamp)", group="eval and output")
    runs_dir: str = _f("runs", "where runs/<name>/ is written", group="eval and output")
    use_tensorboard: bool = _f(True, "write TensorBoard events when tensorboard is installed", group="eval and output")
    tb_project_name: str | None = _f(
        None,
        "TensorBoard events where slime writes them instead of the run directory: $TENSORBOARD_DIR when set, else tensorboard_log/<this>/<--tb-experiment-name>",
        group="eval and output",
    )
    tb_experiment_name: str | None = _f(
        None, "with --tb-project-name: the events' directory name (default: the run name)", group="eval and output"
    )
    use_wandb: bool = _f(
        False, "log every metric to Weights & Biases too (pip install 'vime[wandb]')", group="eval and output"
    )
    wandb_project: str | None = _f(None, "W&B project (default: vime)", group="eval and output")
    wandb_team: str | None = _f(None, "W&B entity (team or user)", group="eval and output")
    wandb_group: str | None = _f(None, "W&B run group", group="eval and output")
    wandb_run_id: str | None = _f(
        None, "W&B run id: the same id resumes the same W&B run (default: the run name)", group="eval and output"
    )
    wandb_mode: str | None = _f(
        None,
        "online, offline (written to disk, no network; wandb sync uploads it later) or disabled (default: $WANDB_MODE, else online)",
        ("online", "offline", "disabled"),
        group="eval and output",
    )
    wandb_key: str | None = _f(None, "W&B API key (default: $WANDB_API_KEY or wandb login)", group="eval and output")
    wandb_host: str | None = _f(None, "W&B server URL (a self-hosted one)", group="eval and output")
    wandb_dir: str | None = _f(None, "where W&B writes its files (default: the run directory)", group="eval and output")
    quiet: bool = _f(
        False,
        "no progress bar or per-step lines on stderr (log.txt and metrics.jsonl still get them)",
        group="eval and output",
    )
    # --- pass-through: collected by parse_args from flags vime has no field for ---
    vllm_args: dict = _f(
        {},
        "every --vllm-NAME VALUE flag as {NAME: VALUE} (True for a bare switch): the arguments of the vLLM servers vime starts",
        group="passthrough",
    )
    slime_flags: dict = _f(
        {},
        "slime/Megatron flags vime reads but keeps no setting of its own for (model shape, parallel sizes, ...), as given: see vime/compat.py",
        group="passthrough",
    )
    # --- derived: set by validate() or by the run, once; not flags (config.yaml records them) ---
    mode: str | None = _f(
        None,
        "sync, one-step-off, fully-async or decoupled: from the entry point, --max-staleness and --rollout-function-path",
        group=DERIVED,
    )
    model_dir: str | None = _f(None, "the local directory --hf-checkpoint resolved to", group=DERIVED)
    # where the seed system's plug-ins reach the engines (rollout/compat.py's router), set on the
    # run's args when it starts; not settings (a `vllm_` key of a config is a vLLM server flag)
    vllm_router_ip: ClassVar[str | None] = None
    vllm_router_port: ClassVar[int | None] = None
    eval_sets: list = _f(
        [],
        "every held-out set and the settings it overrides, from --eval-config or --eval-prompt-data (vime/eval_sets.py)",
        group=DERIVED,
    )
    custom_config: dict = _f(
        {}, "the keys of --custom-config-path that are no vime setting: attributes of args for plug-ins", group=DERIVED
    )
    # --- the run's live objects (engine clients, tokenizer, fully-async worker): not settings,
    # never written or pickled; slime's rollout signatures pass only args, so this is how the
    # run hands them to rollout and generate functions ---
    runtime: Any = field(
        default=None, repr=False, compare=False, metadata={"help": "", "choices": None, "group": RUNTIME}
    )

    # ---- derived values, so no caller recomputes them ----
    @property
    def normalize_advantages_std(self) -> bool:
        return (
            not self.disable_grpo_std_normalization and estimator_of(self.advantage_estimator).advantages.std_normalized
        )

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout batch; the policy version advances by this much per step."""
        # max(1, ...): validate() reports a zero batch size in one line; this must not divide by it first
        return self.samples_per_rollout // max(1, self.global_batch_size or self.samples_per_rollout)

    @property
    def min_staleness(self) -> int:
        """The largest staleness even sync training has, in optimizer steps: the last optimizer
        step of a rollout is steps_per_rollout - 1 past the weights that generated it, and
        engines lag up to --update-weights-interval - 1 rollouts more."""
        return self.update_weights_interval * self.steps_per_rollout - 1

    @property
    def sft_rollout(self) -> bool:
        """The run's samples are the data's conversations (the SFT rollout function)."""
        return self.rollout_function_path == SFT_ROLLOUT_FN

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / (self.run_name or "run")

    def validate(self, entry: str = "sync") -> Config:
        """Fail at start-up, not an hour in; fill in the defaults that depend on other fields and
        the derived `mode`. `entry`: sync (train.py), async (train_async.py) or eval (`vime eval`,
        which checks only what evaluation needs). Every consistency check of the settings is here."""
        if entry not in ENTRIES:
            raise ValueError(f"validate(entry={entry!r}): one of {ENTRIES}")
        if self.custom_config_path is not None:
            from vime.config_files import apply_custom_config  # slime applies it first: its keys override the flags

            apply_custom_config(self)
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        if self.sft_rollout and self.n_samples_per_prompt == _FIELDS["n_samples_per_prompt"].default:
            self.n_samples_per_prompt = 1  # slime's default: SFT trains each conversation once
        steps = self.num_steps_per_rollout
        if steps is not None and steps >= 1 and self.samples_per_rollout % steps == 0:
            gbs = self.samples_per_rollout // steps
            if self.global_batch_size not in (None, gbs):
                raise ConfigError(
                    f"--num-steps-per-rollout {steps} makes the global batch {gbs} samples, but --global-batch-size is "
                    f"{self.global_batch_size}: give only one of them"
                )
            self.global_batch_size = gbs
        if self.global_batch_size is None:
            self.global_batch_size = self.samples_per_rollout
        if self.eval_max_response_len is None:
            self.eval_max_response_len = self.rollout_max_response_len
        checks = []
        for name, f in _FIELDS.items():  # argparse checks choices on the command line; a YAML value gets here unchecked
            value, choices = getattr(self, name), f.metadata["choices"]
            if choices is not None and value is not None and value not in choices:
                checks.append((True, f"--{name.replace('_', '-')} {value!r}: use one of {', '.join(choices)}"))
        checks += _common_checks(self) + (_eval_checks(self) if entry == "eval" else _train_checks(self, entry))
        for bad, msg in checks:
            if bad:
                raise ConfigError(msg)
        from vime.eval_sets import resolve

        self.eval_sets = resolve(self)
        if self.load_debug_rollout_data is not None or self.sft_rollout:
            # slime's rule: saved rollouts, or the data's own conversations, stand in for the engines
            self.debug_train_only = True
        if entry != "eval":
            self.mode = self._derive_mode(entry)
            self._resolve_correction()
            if self.over_sampling_batch_size is not None and self.rollout_function_path == FULLY_ASYNC_FN:
                raise ConfigError(
                    f"--over-sampling-batch-size is the sync batch's round of prompts; the fully-async worker ({self.mode}) "
                    "keeps --rollout-concurrency groups in flight instead: give that, or drop the flag"
                )
            if self.partial_rollout:
                self.update_in_flight = "resume"
            self.partial_rollout = self.update_in_flight == "resume"  # slime's name, for plug-ins that read it
            if self.update_in_flight != "keep" and self.rollout_function_path != FULLY_ASYNC_FN:
                raise ConfigError(
                    f"--update-in-flight {self.update_in_flight} acts on the fully-async worker's groups, and this run "
                    f"({self.mode}) has nothing in flight at a push: use the fully-async rollout function or --max-staleness K"
                )
            if self.tis_level != "token" and not self.use_tis:
                raise ConfigError(
                    f"--tis-level {self.tis_level} weighs TIS per sequence, and this run has no TIS "
                    f"(off-policy correction: {self.off_policy_correction}): add --use-tis, or drop --tis-level"
                )
            if self.run_name is None:  # a run needs its directory's name from the start (locks, logs)
                self.run_name = time.strftime("%Y%m%d-%H%M%S") + f"-{self.mode}"
        if self.api_key is None:
            self.api_key = os.environ.get("VIME_API_KEY") or None
        return self

    def _derive_mode(self, entry: str) -> str:
        """The one place the training mode is decided. train_async.py with --max-staleness is
        decoupled, which needs the continuous worker: the default rollout function becomes the
        fully-async one; a rollout function of one's own runs one-step-off, overlapping only as
        far as --max-staleness allows. The names are rows of `vime.modes.MODES`."""
        if entry == "sync" or self.sft_rollout:  # SFT generates nothing: there is nothing to overlap
            return "sync"
        if self.max_staleness is not None:
            if self.rollout_function_path == DEFAULT_ROLLOUT_FN:
                self.rollout_function_path = FULLY_ASYNC_FN
            return "decoupled" if self.rollout_function_path == FULLY_ASYNC_FN else "one-step-off"
        return "fully-async" if self.rollout_function_path == FULLY_ASYNC_FN else "one-step-off"

    def _resolve_correction(self) -> None:
        """Turn --off-policy-correction into the TIS/rejection fields the loss reads, and record
        which one was taken (config.yaml and the start-up line show it). Async runs train on
        samples up to several versions old, and uncorrected they lost ~20 points of held-out
        accuracy on the demo task at staleness 4 (bench/RESULTS.md), so auto corrects wherever a
        sample can be stale; sync and --max-staleness 0 train what sync trains, uncorrected."""
        chosen = self.off_policy_correction
        if chosen == "auto":
            if self.use_tis or self.use_rs or self.m2_threshold is not None:
                chosen = "custom"
            elif (
                not MODES[self.mode].overlaps
                or self.max_staleness == 0
                or self.use_rollout_logprobs
                or self.loss_type == "sft_loss"  # weighs no token by a ratio
            ):
                chosen = "none"
            else:
                chosen = ASYNC_CORRECTION
        if chosen != "custom":
            for name, value in CORRECTIONS[chosen].items():
                if getattr(self, name) not in (value, _FIELDS[name].default):
                    flag = "--" + name.replace("_", "-")
                    raise ConfigError(
                        f"{flag} {getattr(self, name)} contradicts --off-policy-correction {chosen}, which sets it to {value}: "
                        f"give --off-policy-correction custom to use your own {flag}, or drop it"
                    )
                setattr(self, name, value)
            if chosen != "none" and self.use_rollout_logprobs:
                raise ConfigError(
                    f"--off-policy-correction {chosen} weighs π_old against the engine's log-probs, which "
                    "--use-rollout-logprobs makes π_old: drop one"
                )
        self.off_policy_correction = chosen

    def correction_summary(self) -> str:
        """One line for the start of a run: which correction, and what it does to a token."""
        veto = (
            f"; sequences with a token ratio below {self.rs_veto_threshold:g} dropped"
            if self.rs_veto_threshold is not None
            else ""
        )
        if not (self.use_tis or self.use_rs or self.m2_threshold is not None):
            return "off-policy correction: none" + veto
        parts = []
        if self.m2_threshold is not None:
            parts.append(
                f"tokens of largest (log π_old/π_rollout)² masked until the rest's mean is ≤ {self.m2_threshold:g}"
            )
        if self.use_tis:
            band = f"[{self.tis_clip_low:g}, {self.tis_clip:g}]"
            parts.append(
                (
                    f"π_old/π_rollout clamped to {band}"
                    if self.tis_mode == "truncate"
                    else f"tokens with π_old/π_rollout outside {band} masked"
                )
                + ("" if self.tis_level == "token" else f", one weight per sequence ({self.tis_level})")
            )
        if self.use_rs:
            parts.append(
                f"{self.rs_level}s with a ratio outside [{self.rs_lower_bound:g}, {self.rs_upper_bound:g}] dropped"
            )
        return f"off-policy correction: {self.off_policy_correction} ({'; '.join(parts)}{veto}); --off-policy-correction none turns it off"

    def to_dict(self) -> dict[str, Any]:
        """Every setting and derived value, for config.yaml; a secret shows only that it was set."""
        d = {name: copy.deepcopy(getattr(self, name)) for name, f in _FIELDS.items() if f.metadata["group"] != RUNTIME}
        for secret in ("api_key", "wandb_key"):
            if d[secret]:
                d[secret] = "<set>"
        return d

    def __getstate__(self) -> dict[str, Any]:
        """Trainer ranks are spawned with the config: the live objects stay in this process."""
        return {**self.__dict__, "runtime": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> Config:
        """The settings copied, the live objects shared: a plug-in that copies `args` to change a
        few settings for itself (the seed's multi-agent example) still reaches the run's engines."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, value if name == "runtime" else copy.deepcopy(value, memo))
        return clone

    # ---- frozen once the run is assembled (vime/launch/assemble.py) ----

    def freeze(self) -> Config:
        """From now on every attribute write raises: the run's settings are fixed once it is
        assembled, and its live objects (engines, runtime, router) are in its RunContext. The mark
        is this object's alone: a copy (copy.copy, deepcopy, `derived`) can be changed; a trainer
        rank's pickle keeps it."""
        self.__dict__["_frozen"] = True
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_frozen":  # deepcopy sets every attribute it finds: the copy is not frozen
            return
        if "_frozen" in self.__dict__:
            raise dataclasses.FrozenInstanceError(
                f"args.{name}: the run's config is frozen once the run is assembled; live state belongs in "
                "RunContext (vime/launch/context.py), a changed setting in a copy (Config.derived)"
            )
        object.__setattr__(self, name, value)

    def __copy__(self) -> Config:
        """The settings, not frozen, the live runtime dropped (as a pickle drops it)."""
        clone = object.__new__(type(self))
        clone.__dict__.update({k: v for k, v in self.__getstate__().items() if k != "_frozen"})
        return clone

    def derived(self, **changes: Any) -> Config:
        """A new config with `changes` (dataclasses.replace): how a value found after validation
        (the model's directory, --num-epoch's rollouts) joins the run's config without a write
        into it. The attributes --custom-config-path gave plug-ins come along."""
        clone = dataclasses.replace(self, **changes)
        clone.__dict__.update({k: v for k, v in self.__dict__.items() if k not in _FIELDS and k != "_frozen"})
        return clone


def _one_file_per_rollout(template: str) -> bool:
    """Whether a debug-rollout path names a file of its own for each rollout (`{rollout_id}`,
    with a format spec or not). One that does not format passes here: preflight's
    `debug_rollout.check_template` names what is wrong with it."""
    try:
        return template.format(rollout_id=0) != template.format(rollout_id=1)
    except (KeyError, IndexError, ValueError, AttributeError):
        return True


def _common_checks(c: Config) -> list[tuple[bool, str]]:
    """What any entry point needs: the model, sampling, engines, and finite numbers."""
    from vime.rollout.rewards.grading import BUILTIN_RM_TYPES  # here: the rewards package imports this module

    return [
        (c.hf_checkpoint is None, "--hf-checkpoint is required (an HF model directory, or 'smollm2')"),
        (c.rollout_temperature < 0, "--rollout-temperature must be >= 0 (0 = greedy)"),
        (not 0 < c.rollout_top_p <= 1, "--rollout-top-p must be in (0, 1]"),
        (c.rollout_max_response_len < 1, "--rollout-max-response-len must be at least 1"),
        (c.rollout_health_check_interval < 0, "--rollout-health-check-interval must be >= 0 seconds (0: no probes)"),
        (c.rollout_health_check_timeout <= 0, "--rollout-health-check-timeout must be > 0 seconds"),
        (
            c.eval_limit is not None and c.eval_limit < 1,
            f"--eval-limit {c.eval_limit}: give at least 1 (leave it out to evaluate every prompt)",
        ),
        *(
            (
                True,
                f"--rollout-engine-urls: {u!r} is not an engine URL; give http://host:port (comma-separated for several)",
            )
            for u in c.rollout_engine_urls
            if not _is_engine_url(u)
        ),
        (
            c.reward_timeout <= 0,
            f"--reward-timeout {c.reward_timeout:g} must be > 0 seconds (it bounds each reward call; a hung one scores 0)",
        ),
        (
            c.rm_type == "remote_rm" and not c.custom_rm_path and c.rm_url is None,
            "--rm-type remote_rm needs --rm-url http://host:port/path, the reward model's endpoint",
        ),
        (
            c.rm_url is not None and not str(c.rm_url).startswith(("http://", "https://")),
            f"--rm-url {c.rm_url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000/reward",
        ),
        (
            c.rm_url is not None and c.rm_type != "remote_rm" and not c.custom_rm_path,
            f"--rm-url is read by --rm-type remote_rm (or by your --custom-rm-path), and this run grades with --rm-type {c.rm_type}: add --rm-type remote_rm",
        ),
        (c.max_turns < 1, f"--max-turns {c.max_turns}: give at least 1"),
        (c.tool_timeout <= 0, f"--tool-timeout {c.tool_timeout:g} must be > 0 seconds"),
        (c.tool_max_output_chars < 1, "--tool-max-output-chars must be at least 1"),
        (
            bool(c.tools) and c.custom_generate_function_path is not None,
            "--tools runs the built-in multi-turn generate, and --custom-generate-function-path replaces it: give one of them",
        ),
        (c.rollout_num_gpus_per_engine < 1, "--rollout-num-gpus-per-engine must be at least 1"),
        (c.rollout_num_engines is not None and c.rollout_num_engines < 1, "--rollout-num-engines must be at least 1"),
        (
            c.rollout_num_engines is not None
            and c.rollout_num_gpus is not None
            and c.rollout_num_engines * c.rollout_num_gpus_per_engine != c.rollout_num_gpus,
            f"--rollout-num-engines {c.rollout_num_engines} × --rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine} "
            f"is not --rollout-num-gpus {c.rollout_num_gpus}: give the two that you mean",
        ),
        (
            c.rollout_num_gpus_per_engine != 1 and not _backend(c).tensor_parallel,
            f"--rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine}: {_backend(c).what} has no "
            "tensor parallelism; use 1 (--rollout-num-gpus N then runs N engines of one GPU each) or --rollout-backend "
            + " / ".join(b.name for b in BACKENDS.values() if b.tensor_parallel),
        ),
        (c.eval_temperature is not None and c.eval_temperature < 0, "--eval-temperature must be >= 0 (0 = greedy)"),
        (c.eval_top_p is not None and not 0 < c.eval_top_p <= 1, "--eval-top-p must be in (0, 1]"),
        (c.eval_top_k is not None and c.eval_top_k < -1, "--eval-top-k must be -1 or 0 (off) or a positive count"),
        (
            c.eval_rm_type is not None and c.eval_rm_type not in BUILTIN_RM_TYPES,
            f"--eval-rm-type {c.eval_rm_type!r}: use one of {', '.join(BUILTIN_RM_TYPES)}",
        ),
        (
            c.rollout_max_context_len is not None and c.rollout_max_context_len < 2,
            "--rollout-max-context-len must be at least 2 (a prompt token and a response token)",
        ),
        (
            c.rollout_max_prompt_len is not None
            and c.rollout_max_context_len is not None
            and c.rollout_max_prompt_len >= c.rollout_max_context_len,
            f"--rollout-max-prompt-len {c.rollout_max_prompt_len} leaves no room for a response in "
            f"--rollout-max-context-len {c.rollout_max_context_len}: set it below {c.rollout_max_context_len}",
        ),
        (
            any(not isinstance(s, str) or not s for s in c.rollout_stop),
            "--rollout-stop: every stop string must be non-empty text",
        ),
        (c.reward_key == "", "--reward-key needs a key name, e.g. score"),
        *compat.checks(c),
        (
            c.weight_transport not in _backend(c).transports,
            f"--weight-transport {c.weight_transport} does not reach {c.rollout_backend} engines (they receive by "
            f"{', '.join(t for t in _backend(c).transports if t != 'auto')}): leave it at auto",
        ),
        (
            c.launcher == "ray" and bool(c.rollout_engine_urls),
            "--launcher ray launches engines, --rollout-engine-urls uses running ones: give one of the two",
        ),
        (
            c.launcher == "ray" and c.colocate,
            "--colocate puts the engines on the trainer's GPUs, which Ray does not place: use --launcher local",
        ),
        (
            # checked here, or the first use of ray (placing the engines, after the trainer loaded) was a traceback
            c.launcher == "ray" and importlib.util.find_spec("ray") is None,
            "--launcher ray needs ray in this environment: pip install ray (or make install-ray), or use --launcher local",
        ),
        *_non_finite(c),
    ]


def _backend(c: Config) -> Backend:
    # an unknown name is refused by the choices check; until then, check as the default would
    return BACKENDS.get(c.rollout_backend, BACKENDS["vime"])


def _estimator(c: Config) -> Estimator:
    # an unknown name is refused by the choices check; until then, check as the default would
    return estimator_of(c.advantage_estimator if c.advantage_estimator in estimator_names() else "grpo")


def _sft_checks(c: Config) -> list[tuple[bool, str]]:
    """SFT's flags: the rollout function and the loss go together, and what needs an engine or
    advantages cannot come with them."""
    fn = f"--rollout-function-path {SFT_ROLLOUT_FN}"
    return [
        (
            c.sft_rollout and c.loss_type != "sft_loss",
            f"{fn} hands out the data's own conversations, with no reward: train them with --loss-type sft_loss",
        ),
        (
            c.sft_rollout and c.n_samples_per_prompt != 1,
            f"--n-samples-per-prompt {c.n_samples_per_prompt}: SFT trains each conversation once; drop the flag",
        ),
        (
            c.sft_rollout and c.debug_rollout_only,
            f"--debug-rollout-only trains nothing, and {fn} generates nothing: drop --debug-rollout-only",
        ),
        (
            c.sft_rollout and c.eval_interval is not None,
            f"{fn} starts no engine, so the run evaluates nothing: drop --eval-interval and evaluate a checkpoint "
            "with `vime eval --hf-checkpoint SAVE/STEP`",
        ),
        (
            c.sft_rollout and c.max_staleness is not None,
            f"--max-staleness bounds how old generated tokens are, and {fn} generates nothing: drop it",
        ),
        *(
            (
                c.sft_rollout and bool(value),
                f"{flag} acts on generated samples, and {fn} generates and scores nothing: drop it",
            )
            for flag, value in (
                ("--custom-generate-function-path", c.custom_generate_function_path),
                ("--custom-rm-path", c.custom_rm_path),
                ("--dynamic-sampling-filter-path", c.dynamic_sampling_filter_path),
                ("--tools", c.tools),
            )
        ),
        (
            c.loss_mask_type == "distill_qwen",
            "--loss-mask-type distill_qwen (the last message as raw text after a templated prompt) is not offered: "
            "vime reads every mask from the chat template; use qwen",
        ),
        (
            c.disable_compute_advantages_and_returns and c.loss_type != "sft_loss",
            f"--disable-compute-advantages-and-returns: --loss-type {c.loss_type} trains on advantages; "
            "only --loss-type sft_loss needs none",
        ),
        *(SFTLoss.refused(c) if c.loss_type == "sft_loss" else []),
    ]


def _eval_checks(c: Config) -> list[tuple[bool, str]]:
    return [
        (
            not c.eval_prompt_data and c.eval_config is None,
            "--eval-prompt-data or --eval-config is required (the held-out prompts)",
        )
    ]


def _opd_checks(c: Config) -> list[tuple[bool, str]]:
    """On-policy distillation: slime's rules (a type and, for a teacher in the trainer, its
    checkpoint), and the engine-served teacher, which vime does not have, refused with the one it has."""
    opd_flags = [
        f"--{name.replace('_', '-')}"
        for name in ("opd_type", "opd_teacher_load", "opd_teacher_ckpt_step", "opd_kl_coef")
        if getattr(c, name) != _FIELDS[name].default
    ]
    return [
        (
            not c.use_opd and bool(opd_flags),
            f"{', '.join(opd_flags)} set up on-policy distillation, which is off: add --use-opd, or drop them",
        ),
        (
            c.use_opd and c.opd_type is None,
            "--use-opd needs --opd-type: megatron loads the teacher in the trainer from --opd-teacher-load DIR",
        ),
        (
            c.use_opd and c.opd_type in ("sglang", "vllm"),
            f"--opd-type {c.opd_type} asks for a teacher served by an engine, which vime does not have yet: use "
            "--opd-type megatron --opd-teacher-load DIR (the trainer loads the teacher and scores the tokens)",
        ),
        (
            c.use_opd and c.opd_type == "megatron" and c.opd_teacher_load is None,
            "--opd-type megatron loads the teacher in the trainer: give --opd-teacher-load (an HF model directory "
            "or a vime --save directory)",
        ),
        (
            c.use_opd and c.opd_kl_coef <= 0,
            f"--opd-kl-coef {c.opd_kl_coef:g} gives the teacher no weight: use a positive coefficient, or drop --use-opd",
        ),
        (
            c.opd_teacher_ckpt_step is not None and c.opd_teacher_ckpt_step < 0,
            f"--opd-teacher-ckpt-step {c.opd_teacher_ckpt_step} is not a step: give a step of the --opd-teacher-load directory",
        ),
    ]


def _train_checks(c: Config, entry: str) -> list[tuple[bool, str]]:
    return [
        (c.prompt_data is None, "--prompt-data is required (a JSONL or Parquet file of prompts)"),
        (c.rollout_batch_size < 1, "--rollout-batch-size must be at least 1"),
        *_opd_checks(c),
        (
            c.debug_rollout_only and (c.debug_train_only or c.load_debug_rollout_data is not None),
            "--debug-rollout-only starts no trainer and --debug-train-only / --load-debug-rollout-data no engine: give one of them",
        ),
        (
            c.debug_rollout_only and c.max_staleness is not None,
            "--debug-rollout-only pushes no weights, so --max-staleness would hold the worker back forever: drop one",
        ),
        (
            c.save_debug_rollout_data is not None and c.load_debug_rollout_data is not None,
            "--save-debug-rollout-data with --load-debug-rollout-data would write back what was read: give one",
        ),
        (
            c.opsm_delta != _FIELDS["opsm_delta"].default and not c.use_opsm,
            f"--opsm-delta {c.opsm_delta:g} is OPSM's threshold: add --use-opsm, or drop it",
        ),
        (
            c.loss_type == "custom_loss" and (_estimator(c).loss != BASE_LOSS or c.eps_clip_c is not None),
            "--loss-type custom_loss replaces the policy term, and --advantage-estimator "
            f"{'/'.join(name for name in POLICY_LOSSES if name != BASE_LOSS)} and --eps-clip-c "
            "change that term: drop one (the custom term gets GRPO's advantages, the correction and OPSM)",
        ),
        (
            c.debug_train_only and c.load_debug_rollout_data is None and not c.sft_rollout,
            "--debug-train-only starts no engine: give --load-debug-rollout-data (the rollouts to train on), "
            f"or SFT's --rollout-function-path {SFT_ROLLOUT_FN}",
        ),
        *_sft_checks(c),
        (
            c.debug_rollout_only and (c.save is not None or c.load is not None),
            "--debug-rollout-only trains nothing, so it saves and loads no checkpoint: drop --save/--load",
        ),
        *[
            (
                path is not None and not _one_file_per_rollout(path),
                f"--{flag} {path}: put {{rollout_id}} in the path (one file per rollout), e.g. {(path or '').rstrip('/')}/{{rollout_id}}.pt",
            )
            for flag, path in (
                ("save-debug-rollout-data", c.save_debug_rollout_data),
                ("load-debug-rollout-data", c.load_debug_rollout_data),
            )
        ],
        (
            c.over_sampling_batch_size is not None and c.over_sampling_batch_size < c.rollout_batch_size,
            f"--over-sampling-batch-size {c.over_sampling_batch_size} is below --rollout-batch-size {c.rollout_batch_size}: "
            "a round of prompts must be able to fill a batch; raise it or leave it out",
        ),
        (
            c.over_sampling_batch_size is not None and c.dynamic_sampling_filter_path is None,
            "--over-sampling-batch-size only matters with --dynamic-sampling-filter-path (which groups to drop): give the filter or drop the flag",
        ),
        (c.n_samples_per_prompt < 1, "--n-samples-per-prompt must be at least 1"),
        (c.global_batch_size < 1, "--global-batch-size must be at least 1"),
        (
            c.global_batch_size >= 1 and c.samples_per_rollout % c.global_batch_size != 0,
            f"--rollout-batch-size × --n-samples-per-prompt = {c.samples_per_rollout} is not a multiple of "
            f"--global-batch-size {c.global_batch_size}: pick a global batch size that divides it",
        ),
        (
            c.num_rollout is None and c.num_epoch is None,
            "give --num-rollout (steps) or --num-epoch (passes over the data)",
        ),
        (c.num_rollout is not None and c.num_rollout < 1, "--num-rollout must be at least 1"),
        (
            c.save_interval is not None and c.save is None,
            "--save-interval needs --save DIR (where to write checkpoints)",
        ),
        (c.overwrite_save and c.save is None, "--overwrite-save needs --save DIR (the checkpoints it may replace)"),
        (
            c.eval_interval is not None and not c.eval_prompt_data and c.eval_config is None,
            "--eval-interval needs --eval-prompt-data or --eval-config (held-out prompts)",
        ),
        (c.update_weights_interval < 1, "--update-weights-interval must be at least 1"),
        (c.lr < 0, "--lr must be >= 0"),
        (
            entry == "async" and c.colocate,
            "train_async.py cannot --colocate: async training overlaps generation with training, so trainer and engine need their own "
            "devices (or two processes on one GPU without --colocate); use train.py for colocated runs",
        ),
        (c.max_staleness is not None and c.max_staleness < 0, "--max-staleness must be >= 0"),
        (
            c.max_staleness is not None and c.max_staleness < c.min_staleness,
            f"--max-staleness {c.max_staleness} cannot hold: with --update-weights-interval {c.update_weights_interval} and "
            f"{c.steps_per_rollout} optimizer step(s) per rollout even sync training trains tokens {c.min_staleness} steps old; "
            f"raise --max-staleness to {c.min_staleness} or push and step once per rollout",
        ),
        (
            entry == "sync" and c.max_staleness is not None,
            "--max-staleness is decoupled async training: run it with train_async.py",
        ),
        (
            c.use_rollout_logprobs and (c.use_tis or c.use_rs),
            "--use-tis/--use-rs weigh π_old against the engine's log-probs, which --use-rollout-logprobs makes π_old: drop one",
        ),
        (
            not 0 <= c.tis_clip_low < c.tis_clip,
            f"--tis-clip-low {c.tis_clip_low} must be >= 0 and below --tis-clip {c.tis_clip}",
        ),
        *_estimator(c).refused(c),
        (c.lora_rank < 0, f"--lora-rank {c.lora_rank} must be >= 1 (or 0: full fine-tuning)"),
        (c.lora_rank > 0 and c.lora_alpha <= 0, f"--lora-alpha {c.lora_alpha} must be > 0"),
        (not 0 <= c.lora_dropout < 1, f"--lora-dropout {c.lora_dropout} must be in [0, 1)"),
        (
            c.gamma != 1.0 and not _estimator(c).advantages.discounted,
            f"--gamma {c.gamma:g} discounts REINFORCE++'s returns: it needs --advantage-estimator "
            + " or ".join(name for name, cls in ADVANTAGES.items() if cls.discounted),
        ),
        (
            not 0 < c.gamma <= 1,
            f"--gamma {c.gamma:g} must be in (0, 1]",
        ),
        (
            c.gamma != 1.0 and c.custom_advantage_function_path is not None,
            "--gamma and --custom-advantage-function-path both set the advantages: drop one",
        ),
        (
            c.loss_type == "custom_loss" and c.custom_loss_function_path is None,
            "--loss-type custom_loss needs --custom-loss-function-path (the per-token policy term)",
        ),
        (
            c.loss_type != "custom_loss" and c.custom_loss_function_path is not None,
            "--custom-loss-function-path is used with --loss-type custom_loss: add it, or drop the path",
        ),
        (
            c.m2_threshold is not None and not c.m2_threshold > 0,
            f"--m2-threshold {c.m2_threshold} must be above 0 (M2PO's paper uses 0.04)",
        ),
        (
            c.rs_veto_threshold is not None and not 0 < c.rs_veto_threshold < 1,
            f"--rs-veto-threshold {c.rs_veto_threshold} must be between 0 and 1 (a ratio far below 1, e.g. 1e-4)",
        ),
        (
            c.use_rollout_logprobs and (c.rs_veto_threshold is not None or c.custom_tis_function_path is not None),
            "--rs-veto-threshold/--custom-tis-function-path weigh π_old against the engine's log-probs, which "
            "--use-rollout-logprobs makes π_old: drop one",
        ),
        (
            c.eps_clip_c is not None and not c.eps_clip_c > 1,
            f"--eps-clip-c {c.eps_clip_c} must be above 1 (the dual clip caps -A·ratio at -A·c; c <= 1 would cap the unclipped ratio itself)",
        ),
        (
            not 0 <= c.rs_lower_bound < c.rs_upper_bound,
            f"--rs-lower-bound {c.rs_lower_bound} must be >= 0 and below --rs-upper-bound {c.rs_upper_bound}",
        ),
        (
            c.partial_rollout and c.update_in_flight not in ("keep", "resume"),
            f"--partial-rollout is --update-in-flight resume, and --update-in-flight is {c.update_in_flight}: give one",
        ),
        (c.rollout_concurrency is not None and c.rollout_concurrency < 1, "--rollout-concurrency must be at least 1"),
        (c.max_tokens_per_gpu < 1, "--max-tokens-per-gpu must be at least 1"),
        (c.micro_batch_size is not None and c.micro_batch_size < 1, "--micro-batch-size must be at least 1"),
        (
            c.num_steps_per_rollout is not None
            and (c.num_steps_per_rollout < 1 or c.samples_per_rollout % c.num_steps_per_rollout != 0),
            f"--num-steps-per-rollout {c.num_steps_per_rollout} must be at least 1 and divide the rollout's "
            f"{c.samples_per_rollout} samples (--rollout-batch-size × --n-samples-per-prompt)",
        ),
        (
            c.gradient_checkpointing_layers is not None and c.gradient_checkpointing_layers < 1,
            "--gradient-checkpointing-layers must be at least 1",
        ),
        (
            c.gradient_checkpointing_layers is not None and not c.gradient_checkpointing,
            "--gradient-checkpointing-layers needs --gradient-checkpointing",
        ),
        (c.lr_warmup_iters < 0, "--lr-warmup-iters must be >= 0"),
        (not 0 <= c.min_lr <= c.lr, f"--min-lr {c.min_lr} must be between 0 and --lr {c.lr}"),
        (
            c.lr_warmup_fraction is not None and not 0 <= c.lr_warmup_fraction < 1,
            f"--lr-warmup-fraction {c.lr_warmup_fraction} must be in [0, 1)",
        ),
        (
            c.lr_warmup_fraction is not None and c.lr_warmup_iters != 0,
            "--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: give one",
        ),
        (c.lr_decay_iters is not None and c.lr_decay_iters < 1, "--lr-decay-iters must be at least 1"),
        (
            c.lr_decay_style != "constant" and c.lr_decay_iters is not None and c.lr_decay_iters <= c.lr_warmup_iters,
            f"--lr-decay-iters {c.lr_decay_iters} must be above --lr-warmup-iters {c.lr_warmup_iters}: the decay counts the warm-up's steps",
        ),
        (c.weight_decay < 0, "--weight-decay must be >= 0"),
        (c.optimizer == "sgd" and not 0 <= c.sgd_momentum < 1, "--sgd-momentum must be in [0, 1)"),
        (c.adam_eps <= 0, "--adam-eps must be > 0"),
        (
            c.rollout_max_prompt_len is not None and c.rollout_max_prompt_len < 1,
            "--rollout-max-prompt-len must be at least 1",
        ),
        (c.update_weights_timeout <= 0, "--update-weights-timeout must be > 0 seconds"),
        (c.update_weight_buffer_size < 1, "--update-weight-buffer-size must be at least 1 byte"),
        (c.max_bad_steps < 1, "--max-bad-steps must be at least 1"),
    ]


def _is_engine_url(u: Any) -> bool:
    from urllib.parse import urlsplit

    if not isinstance(u, str):
        return False
    try:
        parts = urlsplit(u)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _non_finite(cfg: Config) -> list[tuple[bool, str]]:
    """NaN passes every `<` and `>` check (`--rollout-temperature nan` sampled garbage), and inf
    most of them: no float setting may be either."""
    out = []
    for name in _FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, float) and not math.isfinite(value):
            out.append((True, f"--{name.replace('_', '-')} {value}: give a finite number"))
    return out


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
FLAGS = [name for name, f in _FIELDS.items() if f.metadata["group"] not in (DERIVED, RUNTIME, PASSTHROUGH)]


def _base_type(tp: Any) -> Any:
    """`int | None` → int; keeps list/dict/bool/str/float."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


_HINTS = typing.get_type_hints(Config)


def _coerce(name: str, value: Any) -> Any:
    """Turn a YAML or CLI value into the field's type, or raise a one-line ConfigError."""
    tp = _base_type(_HINTS[name])
    flag = "--" + name.replace("_", "-")
    sep = _FIELDS[name].metadata["sep"]
    if value is None:
        return None
    try:
        # YAML hands over typed values, the command line strings: a YAML value is taken only where
        # its string would be (`rollout_batch_size: 4.7` used to become 4, `save: true` "True")
        if isinstance(value, bool) and tp is not bool:
            raise ValueError(value)
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if tp is str and not isinstance(value, (str, int)):
            raise ValueError(value)
        if tp is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp is list and isinstance(value, list) and _FIELDS[name].metadata["nargs"]:
            if len(value) != 1:  # several values on the command line (or a YAML list): each one item
                return [_maybe_int(v) if isinstance(v, str) and sep else v for v in value]
            value = value[0]  # one value: a JSON list, a comma-separated list or one item
        if tp in (dict, list):
            if isinstance(value, tp):
                return value
            text = str(value).strip()
            if tp is list and text and not text.startswith("["):
                if sep is None:
                    return [text]
                return [_maybe_int(v.strip()) for v in text.split(sep) if v.strip()]
            parsed = json.loads(text) if text else tp()
            if not isinstance(parsed, tp):
                raise ValueError(value)
            return parsed
        return tp(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        kind = {
            dict: "a JSON object",
            list: "a JSON list or comma-separated values",
            int: "a whole number",
            float: "a number",
            bool: "true or false",
            str: "text (quote it in a YAML file)",
        }.get(tp, tp.__name__)
        raise ConfigError(f"{flag}: cannot read {value!r} as {kind}") from None


def _maybe_int(s: str) -> Any:
    try:
        return int(s)
    except ValueError:
        return s


def build_parser(prog: str = "train.py", description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file of settings (keys as flag names, with - or _); flags override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in FLAGS:
        f = _FIELDS[name]
        g = f.metadata["group"]
        grp = groups.setdefault(g, parser.add_argument_group(g))
        flag = "--" + name.replace("_", "-")
        tp = _base_type(_HINTS[name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if tp is bool:
            grp.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=_literal(f.metadata["help"]) + f" (default: {'auto' if default is None else default})",
            )
        else:
            grp.add_argument(
                flag,
                default=argparse.SUPPRESS,
                metavar=tp.__name__.upper(),
                choices=f.metadata["choices"],
                nargs=f.metadata["nargs"],
                help=_literal(f.metadata["help"]) + _literal(f" (default: {default})"),
            )
    compat.add_arguments(parser)
    return parser


def _literal(help_text: str) -> str:
    """argparse formats help with `%`: a bare one (a percentage, a default holding one) would
    print a dict of the parser's fields in the middle of the text."""
    return help_text.replace("%", "%%")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error: YAML lets the last one
    win, and a run file with `lr` twice trained with whichever came second, unsaid."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise ConfigError(f"'{key}' is given twice (lines {seen[key]} and {line}): keep one")
            if isinstance(key, str):
                seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path, extras: dict[str, Any] | None = None, what: str = "config file") -> dict[str, Any]:
    """The settings of a YAML file, each read as its flag is. `extras` (--custom-config-path):
    where keys that are no vime setting go, instead of being refused; `what` names the file's
    kind in errors."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} {p} not found")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ConfigError as e:
        raise ConfigError(f"{what} {p}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {p} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{what} {p} cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p} must hold a mapping of flag names to values")
    out: dict[str, Any] = {"slime_flags": {}, "vllm_args": {}}
    given: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in given:  # rollout-batch-size and rollout_batch_size: one flag
            raise ConfigError(f"{what} {p}: '{given[name]}' and '{key}' are one flag: keep one")
        given[name] = key
        if name in ("slime_flags", "vllm_args") and isinstance(value, dict):  # as a run's config.yaml records them
            out[name].update(value)
            continue
        if name in compat.FLAGS:
            out["slime_flags"][name] = value
            continue
        if name.startswith("vllm_"):
            out["vllm_args"][str(key)[len("vllm-") :]] = value
            continue
        if _FIELDS.get(name) is not None and name not in FLAGS:
            if extras is not None:
                raise ConfigError(f"{what} {p}: '{key}' is derived by vime, not a setting: remove it")
            continue  # a derived value of a run's config.yaml: derived again
        if name not in _FIELDS and extras is not None:
            extras[str(key)] = value
            continue
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, list(_FIELDS), n=1)
            hint = f" (did you mean {close[0].replace('_', '-')}?)" if close else ""
            raise ConfigError(f"{what} {p}: unknown key '{key}'{hint}")
        out[name] = _coerce(name, value)
    return {k: v for k, v in out.items() if v != {} or k not in ("slime_flags", "vllm_args")}


def parse_args(
    argv: list[str] | None = None, prog: str = "train.py", description: str = "", entry: str = "sync", **overrides: Any
) -> Config:
    """Flags > --config YAML > dataclass defaults; then validate(entry).

    slime's and Megatron's flags (vime/compat.py) land in `slime_flags`, `--vllm-*` flags in
    `vllm_args`; every other flag vime does not know is named in one error (exit 2), each with
    what it is in slime (`compat.ABSENT`)."""
    parser = build_parser(prog, description)
    parsed, rest = parser.parse_known_args(argv)
    vllm_args, unknown = compat.split_vllm_args(rest)
    message = compat.unknown_flags_error(unknown, [o for a in parser._actions for o in a.option_strings])
    if message:  # every flag at once, each with what it is in slime: no edit-and-rerun round per flag
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    ns = vars(parsed)
    ns.pop("_vllm_help", None)  # the help line of --vllm-NAME; given literally, argparse took it
    values: dict[str, Any] = {}
    if ns.get("config"):
        values.update(load_yaml(ns.pop("config")))
    ns.pop("config", None)
    foreign = {k: ns.pop(k) for k in list(ns) if k in compat.FLAGS}
    values["slime_flags"] = {**values.get("slime_flags", {}), **foreign}
    values["vllm_args"] = {**values.get("vllm_args", {}), **vllm_args}
    values.update({k: _coerce(k, v) for k, v in ns.items()})
    values.update(overrides)
    compat.translate(values)
    return Config(**values).validate(entry)

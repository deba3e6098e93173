"""The rollout's settings, `cfg.rollout`: each declared once here, where the rollout lives, with its
type, default and flag help (vime/setting.py); the config reads them from here. Prompts and their
keys, sampling, the rollout function and its plug-ins, debugging one side, multi-turn tools, async
training and the rewards; `model_dir`, the directory --hf-checkpoint resolved to, set at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from vime.modes import DEFAULT_ROLLOUT_FN, SFT_ROLLOUT_FN
from vime.setting import DERIVED, Component, setting
from vime.tool_calls import TOOL_CALL_FORMATS


@dataclass
class RolloutConfig(Component):
    # --- model and data ---
    hf_checkpoint: str | None = setting(
        None,
        "HF model directory, a hub id (online only), or 'smollm2' (embedded SmolLM2-135M-Instruct)",
        group="model and data",
    )
    prompt_data: str | None = setting(
        None, "training prompts: JSONL or Parquet, optionally sliced as path@[a:b]", group="model and data"
    )
    input_key: str = setting("input", "key of the prompt (a string or a list of chat messages)", group="model and data")
    label_key: str = setting(
        "label",
        "key of the reference answer (a dotted key reads nested dicts: reward_model.ground_truth)",
        group="model and data",
    )
    label_format: str = setting(
        "text",
        "text (the label as it is), or gsm8k (the answer after the label's last '####', as in GSM8K's answer column)",
        ("text", "gsm8k"),
        group="model and data",
    )
    metadata_key: str = setting("metadata", "key of a per-row dict passed to rewards", group="model and data")
    tool_key: str | None = setting(
        None,
        "key of a per-row list of OpenAI-style tool schemas, passed to the chat template as tools= (with --apply-chat-template)",
        group="model and data",
    )
    apply_chat_template: bool = setting(
        False, "render prompts with the tokenizer's chat template", group="model and data"
    )
    apply_chat_template_kwargs: dict = setting(
        {}, "JSON dict passed to the chat template, e.g. '{\"enable_thinking\": false}'", group="model and data"
    )
    # --- rollout ---
    rollout_batch_size: int = setting(8, "prompts per rollout step", group="rollout")
    n_samples_per_prompt: int = setting(4, "responses per prompt (the GRPO group size)", group="rollout")
    num_rollout: int | None = setting(None, "rollout steps to run (default: from --num-epoch)", group="rollout")
    num_epoch: int | None = setting(
        None, "passes over the prompt data when --num-rollout is not given", group="rollout"
    )
    rollout_function_path: str = setting(DEFAULT_ROLLOUT_FN, "dotted path of the rollout function", group="rollout")
    custom_generate_function_path: str | None = setting(
        None, "dotted path of an async per-sample generate(args, sample, sampling_params) -> Sample", group="rollout"
    )
    custom_config_path: str | None = setting(
        None,
        "slime's YAML of settings for custom functions: its keys override the flags (checked as flags are); keys that are no vime setting become attributes of args",
        group="rollout",
    )
    rollout_max_response_len: int = setting(256, "max new tokens per response", group="rollout")
    rollout_temperature: float = setting(1.0, "sampling temperature (0 = greedy)", group="rollout")
    rollout_top_p: float = setting(1.0, "nucleus sampling mass", group="rollout")
    rollout_top_k: int = setting(-1, "top-k sampling (-1 = off)", group="rollout")
    rollout_stop_token_ids: list = setting(
        [],
        "extra token ids that end a response (several values, a JSON list or comma-separated)",
        group="rollout",
        nargs="+",
    )
    rollout_stop: list = setting(
        [],
        "strings that end a response, the string kept (several values, or a JSON list)",
        group="rollout",
        nargs="+",
        sep=None,
    )
    rollout_max_prompt_len: int | None = setting(
        None,
        "leave out prompts longer than this many tokens (counted in rollout/skipped_prompts), as slime filters its data",
        group="rollout",
    )
    rollout_max_context_len: int | None = setting(
        None,
        "prompt + response tokens at most: a response stops where its sample reaches this length (default: the model's context)",
        group="rollout",
    )
    # --- debugging one side ---
    save_debug_rollout_data: str | None = setting(
        None,
        "write every rollout the trainer receives to this path, formatted with {rollout_id} (e.g. dbg/{rollout_id}.pt)",
        group="debug",
    )
    load_debug_rollout_data: str | None = setting(
        None,
        "train on rollouts saved by --save-debug-rollout-data (same template) instead of generating; turns on --debug-train-only",
        group="debug",
    )
    debug_train_only: bool = setting(
        False,
        "start no engine: train on --load-debug-rollout-data (or the SFT rollout function's conversations), push nothing, evaluate nothing",
        group="debug",
    )
    debug_rollout_only: bool = setting(
        False,
        "start no trainer: the engines generate with the starting weights and rewards score; metrics and saved rollouts are written",
        group="debug",
    )
    # --- multi-turn tool use ---
    tools: list = setting(
        [],
        "tools the model may call: calculator, python, or module:name of a vime.rollout.tools.calls.Tool; "
        "turns on the built-in multi-turn generate (vime.rollout.tools.multi_turn) and shows the tools' schemas to the chat template",
        group="tools",
        nargs="+",
    )
    max_turns: int = setting(
        4, "model turns per sample at most with --tools (a tool's answer starts the next turn)", group="tools"
    )
    tool_timeout: float = setting(
        10.0, "seconds a tool call may take; a slower one ends its turn with an error the model reads", group="tools"
    )
    tool_call_parser: str = setting(
        "hermes",
        "how a turn's tool call is read (one row of vime.tool_calls; `vime serve --tool-call-parser` reads the same): "
        + "; ".join(f"{f.name}: {f.models}" for f in TOOL_CALL_FORMATS.values()),
        choices=tuple(TOOL_CALL_FORMATS),
        group="tools",
    )
    tool_max_output_chars: int = setting(
        2000,
        "characters of a tool's answer kept in the conversation; a longer one is cut there and counted as an error",
        group="tools",
    )
    unsafe_python_tool: bool = setting(
        False,
        "run the python tool's model-written programs even where no boundary can be set up (no namespaces, no "
        "Landlock, not root): they then run as this user, with its files and processes; unsafe",
        group="tools",
    )
    dynamic_sampling_filter_path: str | None = setting(
        None,
        "DAPO's dynamic sampling: dotted path of a filter fn(args, samples) -> bool or DynamicFilterOutput that judges each "
        "scored group; a dropped group is never trained (counted in rollout/dynamic_filter/*) and more prompts are generated "
        "until the batch is full of kept ones, in every mode. Built in: vime.rollout.filters.check_reward_nonzero_std "
        "(rewards not all equal) and ..._with_fallback; slime's paths to them are accepted",
        group="rollout",
    )
    over_sampling_batch_size: int | None = setting(
        None,
        "with --dynamic-sampling-filter-path, prompt groups started at once whenever the groups kept and in flight cannot fill "
        "the batch (at least --rollout-batch-size; default: it); groups still in flight when the batch is full are aborted and "
        "generated again later. The fully-async worker keeps --rollout-concurrency groups in flight instead",
        group="rollout",
    )
    rollout_shuffle: bool = setting(False, "shuffle prompts every epoch (seeded by --rollout-seed)", group="rollout")
    rollout_seed: int = setting(42, "seed of prompt order and sampling", group="rollout")
    skip_overlong_prompts: bool = setting(
        False,
        "drop prompts too long for the model's context (counted in rollout/skipped_prompts) instead of refusing the data at start-up",
        group="rollout",
    )
    # --- async training ---
    rollout_concurrency: int | None = setting(
        None, "fully-async: prompt groups in flight at once (default: 2 × --rollout-batch-size)", group="async"
    )
    max_staleness: int | None = setting(
        None,
        "train on tokens at most K optimizer steps older than the weights that train them; the fully-async worker then never waits for training (decoupled); 0 trains exactly what sync trains",
        group="async",
    )
    partial_rollout: bool = setting(
        False,
        "slime's name for --update-in-flight resume: abort in-flight requests at each push and resume them from their tokens",
        group="async",
    )
    update_in_flight: str = setting(
        "keep",
        "fully-async and decoupled: what a weight push does to the groups being generated. keep: paused in place, they "
        "go on with the new weights (their earlier tokens stay the old ones'); abort: aborted and generated again from "
        "the start with the new weights (vllm-project/vime's worker); resume: aborted and continued from their tokens "
        "(--partial-rollout)",
        ("keep", "abort", "resume"),
        group="async",
    )
    rollout_process: str = setting(
        "auto",
        "where the rollout's per-sample work runs (the engine requests, their decoding, the rewards): on, in a process of "
        "its own; off, on a thread of the trainer's process, where it takes the GIL from the train step whenever "
        "generation overlaps training (one train step grew ~0.3 s on one GPU). auto: on when the trainer is on a GPU and "
        "generation overlaps training (one-step-off, fully-async, decoupled); a custom generate or rollout function keeps it off",
        ("auto", "on", "off"),
        group="async",
    )
    # --- rewards ---
    rm_type: str = setting(
        "math",
        "built-in reward: math (1/0), exact (1/0, the normalized answer string must equal the label: lists, words), gpqa (1/0, the option letter A-J the response picks against the label's letter or 0-based index), dapo (1/-1), boxed_math, math_shaped (1, or up to 0.5 for a wrong number by its closeness), reasoning_gym (the task's own scorer, for rows of `vime data --task rg:<name>`), remote_rm (a reward model at --rm-url)",
        group="rewards",
    )
    rm_url: str | None = setting(
        None,
        "--rm-type remote_rm: the reward model's URL; each sample is POSTed as JSON {prompt, response, label} "
        "(slime's body) and the JSON answer is its reward; retried while --reward-timeout lasts",
        group="rewards",
    )
    custom_rm_path: str | None = setting(
        None, "dotted path of a reward fn(args, sample) -> float, sync or async", group="rewards"
    )
    custom_reward_post_process_path: str | None = setting(
        None,
        "slime's hook: dotted path of fn(args, samples) -> (raw_rewards, rewards), called on each rollout's samples "
        "after their rewards and before advantages, in every mode; the reward functions' answers reach it as they came "
        "(sample.get_reward_value(args)), and the rewards it returns are trained through --advantage-estimator. "
        "--opd-type sglang or vllm: vime.rollout.on_policy_distillation.post_process_rewards",
        group="rewards",
    )
    group_rm: bool = setting(
        False,
        "slime's --group-rm: --custom-rm-path is called once per prompt group as fn(args, samples) -> one reward per "
        "sample, for rewards that compare a group's answers (a ranking, a pairwise judge), within one --reward-timeout "
        "per group; the whole group is scored, a reward a custom generate set included (slime's rule); the built-in "
        "rewards still score each sample alone",
        group="rewards",
    )
    reward_timeout: float = setting(10.0, "seconds before a reward call scores 0", group="rewards")
    max_failed_reward_steps: int = setting(
        3,
        "stop the run after this many steps in a row in which every sample's reward failed (an error or a timeout: "
        "a reward service or OPD teacher that is down); resume with --load once it is back",
        group="rewards",
    )
    reward_key: str | None = setting(
        None,
        "a reward function that returns a dict is read at this key (default: 'score'); its other numeric values are logged as rollout/reward_<key>",
        group="rewards",
    )
    # --- derived ---
    model_dir: str | None = setting(None, "the local directory --hf-checkpoint resolved to", group=DERIVED)

    @property
    def sft_rollout(self) -> bool:
        """The run's samples are the data's conversations (the SFT rollout function)."""
        return self.rollout_function_path == SFT_ROLLOUT_FN

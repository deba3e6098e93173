"""Every plug-in tried at start-up, before any engine or trainer starts.

A plug-in with the wrong signature, or one that answers in a shape vime cannot use (a filter's
float, an advantage per group instead of per sample, a per-token loss of the wrong length, a
detached one), used to surface as a traceback from inside the trainer or the rollout loop,
minutes in, after the engines had started. Each is now called here, the way the run calls it,
on a small made-up input of the documented types: the run's own first prompts with made-up
responses and rewards, or a made-up micro-batch of two sequences. What does not fit is one
line naming the flag, the function and what is wrong (`PluginError`, `when` the start-up
check). A custom generate and the rollout function are only checked for how they can be
called: running them would need the engines. A custom reward that raises on the made-up
sample is a note, not an error: in the run such a sample scores 0 and is counted, as before.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vime.algorithms.credit import group_advantages
from vime.algorithms.hooks import CUSTOM_LOSS_SIGNATURE, CUSTOM_TIS_SIGNATURE
from vime.algorithms.objective import LossInputs, Objective
from vime.plugins import Plugin, PluginError, SettingWriteError, at, first_line, load_function, load_plugin
from vime.rollout import async_loop
from vime.rollout.data.source import DataSource
from vime.rollout.filters import load_filter
from vime.rollout.generate import GENERATE_SIGNATURE, sampling_params
from vime.rollout.rewards import GROUP_REWARD_SIGNATURE, RewardKeyError, Rewards, RewardSettingError, read_reward
from vime.rollout.rewards import post_process as reward_post_process
from vime.rollout.settings import RolloutConfig
from vime.rollout.types import Sample, Status

WHEN = "start-up check, on made-up input"
ROLLOUT_SIGNATURE = "generate_rollout(args, rollout_id, data_source, evaluation=False) -> RolloutOutput"
ADVANTAGE_SIGNATURE = "fn(args, groups, rewards) -> advantages [groups × n]"
REWARD_SIGNATURE = "fn(args, sample) -> float or dict"


@dataclass
class CheckedPlugins:
    """What the checks loaded, for the run to keep."""

    rollout_fn: Callable[..., Any]
    custom_advantages: Plugin | None = None
    notes: list[str] = field(default_factory=list)  # warnings for the run's log


def check_plugins(args: Any, tokenizer: Any, data_source: DataSource, rewards: Rewards) -> CheckedPlugins:
    """Load and try every plug-in the settings name; PluginError (or the loader's ConfigError)
    on the first that does not fit. The paths are read from their components (`args.rollout`,
    `args.algorithm`); the plug-ins themselves are handed the flat `args`, as the run hands it."""
    ro, al = args.rollout, args.algorithm
    with at(WHEN):
        # SFT's rows are conversations, and it takes none of the plug-ins that score these (Config's checks)
        groups = [] if ro.sft_rollout else made_up_groups(ro, tokenizer, data_source)
        checked = CheckedPlugins(_rollout_function(args, data_source))
        if ro.custom_generate_function_path:
            _custom_generate(args, groups[0][0])
        judge = load_filter(args)
        if judge is not None:
            for g in groups:
                judge(g)
        if al.custom_advantage_function_path:
            checked.custom_advantages = _custom_advantages(args, groups)
        if al.custom_loss_function_path or al.custom_tis_function_path:
            _loss_hooks(args)
        if ro.custom_rm_path:
            checked.notes += _custom_reward(args, rewards, groups[0][0])
        if ro.custom_reward_post_process_path:
            _post_process(args, groups[0][0])
    return checked


def made_up_groups(ro: RolloutConfig, tokenizer: Any, data_source: DataSource) -> list[list[Sample]]:
    """Two groups of --n-samples-per-prompt scored samples, as a rollout hands them on: the
    data's first two prompts (rendered as the run renders them), the first sample of each
    answering with its label (reward 1), the others not (reward 0)."""
    groups = []
    for g in range(2):
        row = data_source.rows[min(g, len(data_source) - 1)]
        prompt, prompt_ids = data_source.renderer.render_row(row, f"{ro.prompt_data} row {g}")
        group = []
        for k in range(ro.n_samples_per_prompt):
            label = row["label"]
            text = f"The answer is \\boxed{{{label}}}." if k == 0 and label else "I am not sure."
            response = list(tokenizer.encode(text, add_special_tokens=False)) or [0]
            n = len(response)
            group.append(
                Sample(
                    index=g * ro.n_samples_per_prompt + k,
                    group_index=g,
                    prompt=prompt,
                    label=label,
                    tokens=list(prompt_ids) + response,
                    response_length=n,
                    response=text,
                    loss_mask=[1] * n,
                    rollout_log_probs=[-1.0] * n,
                    weight_versions=[0] * n,
                    temperature=ro.rollout_temperature,
                    reward=1.0 if k == 0 else 0.0,
                    status=Status.COMPLETED,
                    metadata=dict(row["metadata"]),
                )
            )
        groups.append(group)
    return groups


def _rollout_function(args: Any, data_source: DataSource) -> Callable[..., Any]:
    """vime's own rollout functions as they are (what they raise is vime's, a bug keeps its
    traceback); a user's as a Plugin, checked for the call the run makes."""
    path = args.rollout.rollout_function_path
    if path.startswith("vime."):
        return load_function(path, "--rollout-function-path", signature=ROLLOUT_SIGNATURE)
    plugin = load_plugin(path, "--rollout-function-path", signature=ROLLOUT_SIGNATURE)
    plugin.check_call(ROLLOUT_SIGNATURE, args, 0, data_source)
    _check_args_read(plugin, args)
    return plugin


def _is_async(fn: Callable[..., Any]) -> bool:
    fn = inspect.unwrap(fn)  # a decorator that keeps functools.wraps keeps the answer
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _custom_generate(args: Any, sample: Sample) -> None:
    """Its signature only: generating needs the engines, which start after these checks."""
    plugin = load_plugin(args.rollout.custom_generate_function_path, "--custom-generate-function-path")
    if not _is_async(plugin.fn):
        raise plugin.error(f"is not a coroutine function: it must be {GENERATE_SIGNATURE} (vime awaits it)")
    plugin.check_call(GENERATE_SIGNATURE, args, sample, sampling_params(args))
    _check_args_read(plugin, args)


def _reads_args(node: ast.AST) -> bool:
    """`args.NAME`, read or written."""
    return isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "args"


def _check_args_read(plugin: Plugin, args: Any) -> None:
    """Refuse a plug-in whose module reads `args.NAME` for a NAME vime's args do not have (a
    setting of vllm-project/vime or of Megatron): it would raise AttributeError at that line,
    mid-run. The function that reads it is named (the configured one, or another function of its
    module). Names the module sets itself (`args.NAME = ...`) are its own; a module that sets
    names by `setattr(args, ...)` is not judged, as what it sets cannot be read off its text."""
    module = inspect.getmodule(inspect.unwrap(plugin.fn))
    try:
        tree = ast.parse(inspect.getsource(module)) if module is not None else None
    except (OSError, TypeError, SyntaxError):  # no source to read (a compiled or built-in module)
        return
    if tree is None:
        return
    stored = set()
    for node in ast.walk(tree):
        is_setattr = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
        if is_setattr and node.args and getattr(node.args[0], "id", None) == "args":
            return
        if _reads_args(node) and isinstance(node.ctx, ast.Store):
            stored.add(node.attr)
    # read only where `args` is the run's: in a function that takes a parameter of that name (a
    # module's own `args = parser.parse_args()` or a list called args is not vime's)
    readers: dict[str, str] = {}  # a lacked name -> the first function that reads it
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and "args" in {
            a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)
        }:
            for node in ast.walk(fn):
                reads = _reads_args(node) and not isinstance(node.ctx, ast.Store) and node.attr not in stored
                if reads and not hasattr(args, node.attr):
                    readers.setdefault(node.attr, fn.name)
    if readers:
        by_reader: dict[str, list[str]] = {}
        for name in sorted(readers):
            by_reader.setdefault(readers[name], []).append(f"args.{name}")
        own = getattr(inspect.unwrap(plugin.fn), "__name__", None)
        said = "; ".join(
            f"{plugin.path if reader == own else f'{module.__name__}.{reader}'} reads {', '.join(names)}"
            for reader, names in by_reader.items()
        )
        named = own in by_reader  # else the configured function is named first, then who reads
        raise PluginError(
            f"{plugin.flag} {'' if named else plugin.path + ': '}{said}, which vime does not have: read it with "
            "getattr(args, name, default), or see docs/plugin-compat.md for vime's equivalent"
        )


def _custom_advantages(args: Any, groups: list[list[Sample]]) -> Plugin:
    al = args.algorithm
    plugin = load_plugin(
        al.custom_advantage_function_path, "--custom-advantage-function-path", signature=ADVANTAGE_SIGNATURE
    )
    rewards = torch.tensor([[s.reward for s in g] for g in groups])
    plugin.check_call(ADVANTAGE_SIGNATURE, args, groups, rewards)
    group_advantages(
        groups,
        al.advantage_estimator,
        std_normalize=al.normalize_advantages_std,
        whitened=al.normalize_advantages,
        custom=plugin,
        args=args,
    )
    return plugin


def _loss_hooks(args: Any) -> None:
    """The run's own objective (`Objective.of`, which loads the hooks) on a made-up micro-batch
    of two sequences (3 and 4 response tokens, one masked), and its backward: what the trainer
    does with every micro-batch."""
    objective = Objective.of(args)
    lengths = [3, 4]
    n = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    log_probs = (-0.1 - torch.rand(n, generator=gen)).requires_grad_()
    old = log_probs.detach() + 0.01 * torch.randn(n, generator=gen)
    mask = torch.ones(n)
    mask[4] = 0.0  # a token the model did not generate (a tool's answer)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if objective.custom_loss is not None:
        objective.custom_loss.check_call(
            CUSTOM_LOSS_SIGNATURE, log_probs=log_probs, old_log_probs=old, advantages=old, loss_mask=mask,
            rollout_log_probs=old, seq_ids=seq_ids,
        )  # fmt: skip
    if objective.correction.custom is not None:
        per_sequence = [list(torch.split(x, lengths)) for x in (old, old, mask)]
        objective.correction.custom.check_call(
            CUSTOM_TIS_SIGNATURE, pg_loss=old, total_lengths=[k + 5 for k in lengths], train_log_probs=per_sequence[0],
            rollout_log_probs=per_sequence[1], loss_masks=per_sequence[2], response_lengths=lengths,
        )  # fmt: skip
    sample_mean = objective.agg == "sample_mean"
    t = LossInputs(
        mask=mask,
        advantages=torch.tensor([1.0] * lengths[0] + [-1.0] * lengths[1]),
        rollout_lp=old + 0.01 * torch.randn(n, generator=gen),
        has_rollout=mask,
        seq_ids=seq_ids,
        prompt_lens=torch.full((n,), 5.0),  # total_lengths of a custom TIS function: prompts of 5 tokens
        old=old,
        ref=old.clone() if objective.settings.kl_loss_coef else None,
        weights=torch.cat([torch.full((k,), 1.0 / k) for k in lengths]) if sample_mean else None,
    )
    const = float(len(lengths) if sample_mean else args.rollout.rollout_max_response_len * len(lengths))
    loss, _ = objective(log_probs, torch.rand(n, generator=gen), t, num_tokens=float(mask.sum()), const=const)
    try:
        loss.backward()
    except RuntimeError as e:
        hooks = (objective.custom_loss, objective.correction.custom)
        names = " and ".join(f"{p.flag} {p.path}" for p in hooks if p is not None)
        raise PluginError(
            f"the loss with {names} cannot be differentiated ({first_line(e)}): an in-place change to a tensor it "
            "was given? (VIME_DEBUG=1 shows its traceback)"
        ) from e


def _custom_reward(args: Any, rewards: Rewards, sample: Sample) -> list[str]:
    """Its signature and the kind of answer it gives (a number, or a dict with the reward at
    --reward-key): a wrong kind would score every sample 0. Called once, on the run's own event
    loop (an async reward may hold loop-bound state) and under --reward-timeout. One that
    raises, hangs or answers a non-finite number on the made-up sample is a note: in the run
    such a sample scores 0 and counts in rollout/reward_errors (or _timeouts); a served OPD teacher
    that does not answer it is refused, since every sample would go without its term."""
    ro = args.rollout
    path = ro.custom_rm_path
    signature = GROUP_REWARD_SIGNATURE if ro.group_rm else REWARD_SIGNATURE
    plugin = load_plugin(path, "--custom-rm-path", signature=signature)
    plugin.check_call(signature, args, [sample] if ro.group_rm else sample)
    _check_args_read(plugin, args)
    try:
        value = async_loop.run(rewards.fn(sample))
    except RewardSettingError:  # a setting that cannot work (an OPD teacher of another vocabulary)
        raise
    except SettingWriteError as e:  # it would fail every sample of the run the same way
        raise plugin.raised(e) from e
    except Exception as e:
        timed_out = isinstance(e, TimeoutError)
        what = (
            "took longer than --reward-timeout"
            if timed_out
            else first_line(e)  # a service down: "cannot be reached at URL for 10s (...)"
            if isinstance(e, ConnectionError)
            else f"raised {type(e).__name__}: {first_line(e)}"
        )
        if args.algorithm.teacher_served:  # a teacher not there now would leave the whole run undistilled
            raise RewardSettingError(
                f"--opd-type {args.algorithm.opd_type}: the teacher at --rm-url {ro.rm_url} {what} on a made-up sample at "
                "start-up: start it before the run (the check waits --reward-timeout for it), or check the URL"
            ) from None
        sample.reward_error = "timeout" if timed_out else "error"  # as the run marks it, for the post-process
        return [
            f"--custom-rm-path {path} {what} on a made-up sample of the first prompt at start-up; in the run "
            f"such a sample scores 0 and counts in rollout/reward_{'timeouts' if timed_out else 'errors'}"
        ]
    if rewards.keep_answers:  # any answer: the post-process makes it a reward (checked next, on this one)
        sample.reward_result = value
        return []
    try:
        score, _ = read_reward(ro, value)
    except RewardKeyError:
        raise
    except (TypeError, ValueError):
        raise plugin.error(
            f"returned {repr(value)[:60]} ({type(value).__name__}): it must return a number, "
            "or a dict with the reward at --reward-key"
        ) from None
    if not math.isfinite(score):
        return [
            f"--custom-rm-path {path} returned {score} on a made-up sample at start-up; a non-finite reward scores 0"
        ]
    return []


def _post_process(args: Any, sample: Sample) -> None:
    """--custom-reward-post-process-path called as the run calls it, on the made-up sample with the
    custom reward's answer to it (when the reward answered): it must return one finite reward
    per sample and, for --opd-type sglang, leave the teacher's log-probs on it."""
    plugin = reward_post_process.load_post_process(args.rollout)
    plugin.check_call(reward_post_process.SIGNATURE, args, [sample])
    _check_args_read(plugin, args)
    reward_post_process.post_process(plugin, args, [[sample]])
    if args.algorithm.teacher_served:
        from vime.rollout.on_policy_distillation import check_served

        check_served([sample], args.rollout.custom_reward_post_process_path)

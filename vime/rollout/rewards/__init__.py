"""Rewards: the reward a run trains on, looked up once from its settings and run by its runner.

The package's parts: `answers` (reading the answer a response commits to), `grading` (is it the
label's, and the built-in rm types' scores), both pure; `runner` (the process pool and threads
that bound each call's time, owned by the run); and here, the registry and the scoring of
samples.

A reward never stops a run: one that raises or returns a non-finite number scores 0 and is
counted in `rollout/reward_errors`, one that takes longer than `--reward-timeout` scores 0 and
is counted in `rollout/reward_timeouts`, and each kind of failure is logged once. The one
exception is a result that does not fit the settings (a dict without the `--reward-key` key, a
number where `--reward-key` asks for a dict): every later sample would fail the same way, so it
stops the run with one line (`RewardKeyError`), as does any `RewardSettingError` a reward
function raises (an OPD teacher of another vocabulary).

With `--custom-reward-post-process-path` a reward function's answer need not be a reward: one that
does not read as a reward is kept as it came (`Sample.reward_result`) for the post-process
(`post_process.py`, through `Sample.get_reward_value`), which returns the rewards trained on;
until then such a sample's reward is 0.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import numbers
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from vime.errors import VimeError
from vime.plugins import load_function, read_only
from vime.rollout.rewards.answers import extract_answer, normalize
from vime.rollout.rewards.grading import BUILTIN_RM_TYPES, builtin_score, grade, numeric_credit
from vime.rollout.rewards.runner import GradingTimeout, RewardRunner
from vime.rollout.types import Sample, Status

if TYPE_CHECKING:
    from vime.rollout.settings import RolloutConfig

__all__ = [
    "BUILTIN_RM_TYPES",
    "RewardError",
    "RewardKeyError",
    "RewardSettingError",
    "Rewards",
    "builtin_score",
    "extract_answer",
    "grade",
    "normalize",
    "numeric_credit",
    "read_reward",
    "score_samples",
]

log = logging.getLogger("vime")

# A reward function's result: a number, or a dict read at --reward-key (see read_reward).
RewardFn = Callable[[Sample], Awaitable[Any]]

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32 (torch.finfo(torch.float32).max)
DEFAULT_REWARD_KEY = "score"  # where a dict reward is read without --reward-key (builtin_result's keys: score, acc)
# rm types defined in a module of their own: name -> "module:factory", factory(rollout settings, runner) -> RewardFn
MODULE_RM_TYPES: dict[str, str] = {
    "reasoning_gym": "vime.rollout.data.reasoning_gym:make_reward",
    "remote_rm": "vime.rollout.rewards.remote:make_reward",
}


class RewardError(VimeError, ValueError):
    """A reward setting that cannot work (`--rm-type`, `--custom-rm-path`); raised at start-up."""


class RewardSettingError(RewardError):
    """A reward answer that shows a setting cannot work: raised by the first sample that shows
    it, and not absorbed like other reward failures (every sample would fail the same way)."""


class RewardKeyError(RewardSettingError):
    """A reward result that does not fit `--reward-key`."""


def _is_async(fn: Callable) -> bool:
    # an object whose __call__ is `async def` is awaited too
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _lookup(rewards: Rewards, runner: RewardRunner) -> RewardFn:
    """The async per-sample reward `fn(sample) -> number or dict` of the settings; RewardError
    on one that cannot work. Every call is bounded by the runner's timeout. A custom reward is
    called with `rewards.args` as it is at the call (the run's view, once the run hands it one)."""
    rollout = rewards.settings
    rm_type, custom_rm_path = rollout.rm_type, rollout.custom_rm_path
    if custom_rm_path:
        fn = load_function(custom_rm_path, "--custom-rm-path", RewardError, "fn(args, sample) -> float or dict")
        if _is_async(fn):

            async def custom_async(sample: Sample) -> Any:
                return await asyncio.wait_for(fn(rewards.args, sample), runner.timeout)

            return custom_async

        async def custom_sync(sample: Sample) -> Any:
            # in a thread, so a slow synchronous reward does not stall every in-flight request
            out = await runner.in_thread(fn, rewards.args, sample)
            return await asyncio.wait_for(out, runner.timeout) if inspect.isawaitable(out) else out

        return custom_sync
    if rm_type in MODULE_RM_TYPES:
        module_name, _, factory = MODULE_RM_TYPES[rm_type].partition(":")
        return getattr(importlib.import_module(module_name), factory)(rollout, runner)
    if rm_type not in BUILTIN_RM_TYPES:
        raise RewardError(
            f"unknown --rm-type '{rm_type}': use one of {', '.join([*BUILTIN_RM_TYPES, *MODULE_RM_TYPES])}, or --custom-rm-path module:func"
        )

    async def builtin(sample: Sample) -> dict[str, float]:
        return await runner.grade(rm_type, sample.final_response, sample.label)

    return builtin


GroupRewardFn = Callable[[list[Sample]], Awaitable[Any]]
GROUP_REWARD_SIGNATURE = "fn(args, samples) -> one reward per sample"


def _as_list(answers: Any) -> Any:
    """A group reward's answers as a list where they are an array or a tensor (`tolist`), as
    the post-process's are taken; anything else as it came, for the caller to judge."""
    return answers.tolist() if hasattr(answers, "tolist") and not isinstance(answers, (list, tuple)) else answers


def _lookup_group(rewards: Rewards, runner: RewardRunner) -> GroupRewardFn | None:
    """`--group-rm` with `--custom-rm-path`: the async group reward `fn(samples) -> [reward, ...]`,
    called once per prompt group (slime's batched reward: rewards that compare a group's answers,
    a ranking or a pairwise judge), bounded by the runner's timeout; None otherwise (the built-in
    rewards score each sample alone, as slime's do under --group-rm too)."""
    rollout = rewards.settings
    if not (rollout.group_rm and rollout.custom_rm_path):
        return None
    fn = load_function(rollout.custom_rm_path, "--custom-rm-path", RewardError, GROUP_REWARD_SIGNATURE)

    async def group(samples: list[Sample]) -> Any:
        args = rewards.args
        out = fn(args, samples) if _is_async(fn) else await runner.in_thread(fn, args, samples)
        return await asyncio.wait_for(out, runner.timeout) if inspect.isawaitable(out) else out

    return group


def _is_number(v: Any) -> bool:
    """NumPy scalars too; a bool is an int (slime's dapo `acc` is one). An int past float's range
    (10**400) is none: float() of it raised OverflowError, which ended the run in a traceback."""
    if not isinstance(v, numbers.Real):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _as_float(value: Any) -> float:
    """A reward as a float; ValueError (the sample's error) for one float cannot hold."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"the reward {repr(value)[:40]} is too large for a number") from None


def read_reward(rollout: RolloutConfig, value: Any) -> tuple[float, dict[str, float]]:
    """(the score, the result's other numeric values) of what a reward function returned.

    A dict is read at `--reward-key` (default "score"), as slime reads it: `--rm-type dapo
    --reward-key score` trains on DAPO's ±1. Its other finite numeric values come back to be
    logged as `rollout/reward_<key>` means (the built-ins' `acc`, 1 when right).

    A number is the score, with one exception: from `--custom-rm-path` while `--reward-key` is
    given. The key then says the function returns a dict; a number means it is not the
    function the flag was written for (slime fails on it too), and quietly training on it
    would hide that. A built-in rm type's number is its `score` (reasoning_gym has no other).

    Raises RewardKeyError (which stops the run) when the result does not fit the settings, and
    ValueError (which scores the sample 0, counted) for a value that is not a number.
    """
    key, custom = rollout.reward_key, rollout.custom_rm_path
    source = f"--custom-rm-path {custom}" if custom else f"--rm-type {rollout.rm_type}"
    name = key or DEFAULT_REWARD_KEY
    if not isinstance(value, dict):
        if custom and key is not None and _is_number(value):
            raise RewardKeyError(
                f"--reward-key {key} reads a dict, but {source} returned the number {value!r}: "
                f"drop --reward-key, or return a dict with the key '{key}'"
            )
        if custom or not _is_number(value):
            return _as_float(value), {}  # a string or None is an error of this sample (ValueError/TypeError)
        if name != DEFAULT_REWARD_KEY:
            raise RewardKeyError(
                f"--reward-key {key}: {source} returns one number, its score: drop --reward-key or set it to score"
            )
        value = {DEFAULT_REWARD_KEY: value}
    if name not in value:
        keys = ", ".join(map(str, value)) or "none"
        fix = "set --reward-key to" if key else "pass --reward-key with"
        raise RewardKeyError(
            f"{source} returned a dict without the key '{name}' (its keys: {keys}): {fix} the key that holds the reward"
        )
    score = value[name]
    if not _is_number(score):
        raise ValueError(f"the reward at key '{name}' is {score!r}, not a number")
    extras = {
        str(k): float(v)
        for k, v in value.items()
        if k != name and _is_number(v) and math.isfinite(v)  # strings (slime's `pred`) are not logged
    }
    return _as_float(score), extras


def _read_if_reward(settings: RolloutConfig, answer: Any) -> tuple[float, dict[str, float], Any]:
    """(score, other values, the answer kept for the post-process) of an answer a post-process
    will see: one that reads as a reward (a number, a dict with the reward key) is that reward,
    as always, and not kept; any other (an OPD teacher's answer) is kept, and scores 0 until the
    post-process says."""
    try:
        return (*read_reward(settings, answer), None)
    except (RewardKeyError, TypeError, ValueError):
        return 0.0, {}, answer


class Rewards:
    """The run's reward: its function, looked up once at start-up (so a typo fails before any
    model loads), and the runner its calls go through. The run builds it, the rollout functions
    reach it through `args.runtime.rewards` (score_samples), and the run closes it."""

    def __init__(self, args, runner: RewardRunner | None = None) -> None:
        self.settings: RolloutConfig = args.rollout
        # what a custom reward is handed, read-only: start-up's view, then the run's (`assemble`)
        self.args = read_only(args)
        self.runner = runner or RewardRunner(float(self.settings.reward_timeout))
        self.group_fn = _lookup_group(self, self.runner)
        self.fn = _lookup(self, self.runner) if self.group_fn is None else self._one_of_a_group
        # the answers go to a post-process as they are (post_process.py), which makes them rewards
        self.keep_answers = bool(self.settings.custom_reward_post_process_path)
        self._logged: set[str] = set()  # exception types already logged once
        self.last_failure: str | None = None  # the latest failure, for the line that stops a run (watch.py)

    async def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set `sample.reward`, `sample.reward_error` and `sample.reward_extras` on every sample
        (and with a post-process `sample.reward_result`, an answer that is no reward, as it came), concurrently; returns `{"rollout/reward_errors": n, "rollout/reward_timeouts": m}`
        (`rollout_metrics` counts the same from the samples, so every rollout function reports them).

        FAILED samples score 0 without calling the reward: they have no trustworthy response.
        """
        todo = [s for s in samples if s.status != Status.FAILED]
        for s in samples:
            if s.status == Status.FAILED:
                s.reward, s.reward_error, s.reward_extras, s.reward_result = 0.0, None, {}, None
        if self.group_fn is None:
            results = await asyncio.gather(*(self._safe(s) for s in todo))
        else:  # --group-rm: one call per prompt group, with its samples that have a response
            groups: dict[int, list[Sample]] = {}
            for s in todo:
                groups.setdefault(s.group_index, []).append(s)
            scored = await asyncio.gather(*(self._safe_group(g) for g in groups.values()))
            by_sample = {id(s): r for g, rs in zip(groups.values(), scored) for s, r in zip(g, rs)}
            results = [by_sample[id(s)] for s in todo]
        for s, (score, extras, failure, answer) in zip(todo, results):
            s.reward, s.reward_extras, s.reward_error, s.reward_result = score, extras, failure, answer
        return {
            "rollout/reward_errors": float(sum(r[2] == "error" for r in results)),
            "rollout/reward_timeouts": float(sum(r[2] == "timeout" for r in results)),
        }

    async def _safe(self, sample: Sample) -> tuple[float, dict[str, float], str | None, Any]:
        """(score, other values, failure, the answer kept for a post-process): a failure of any
        kind scores 0 and is "timeout" or "error"; each exception type is logged once. A
        RewardSettingError is a setting that cannot work, so it is raised."""
        try:
            answer = await self.fn(sample)
        except RewardSettingError:
            raise
        except (Exception, KeyboardInterrupt, SystemExit) as e:  # anything a reward can throw; cancellation propagates
            return self._failed(sample, e)
        return self._read(sample, answer)

    async def _safe_group(self, group: list[Sample]) -> list[tuple[float, dict[str, float], str | None, Any]]:
        """`_safe` for a --group-rm reward: a group whose call fails scores 0 in every sample; an
        answer that is not one reward per sample is a setting that cannot work (every group would
        get the same), so it stops the run in one line."""
        try:
            answers = _as_list(await self.group_fn(group))
        except RewardSettingError:
            raise
        except (Exception, KeyboardInterrupt, SystemExit) as e:
            return [self._failed(s, e) for s in group]
        if not isinstance(answers, (list, tuple)) or len(answers) != len(group):
            got = f"{len(answers)} answers" if isinstance(answers, (list, tuple)) else type(answers).__name__
            raise RewardSettingError(
                f"--custom-rm-path {self.settings.custom_rm_path} with --group-rm returned {got} for a group of "
                f"{len(group)} samples: it must return a list of one reward per sample, in the group's order"
            )
        return [self._read(s, a) for s, a in zip(group, answers)]

    async def _one_of_a_group(self, sample: Sample) -> Any:
        """A --group-rm reward asked for one sample (start-up's check, which calls `fn`): the
        sample as a group of one."""
        answers = _as_list(await self.group_fn([sample]))
        if not isinstance(answers, (list, tuple)) or len(answers) != 1:
            raise RewardSettingError(
                f"--custom-rm-path {self.settings.custom_rm_path} with --group-rm returned {repr(answers)[:60]} for a "
                "group of 1 sample: it must return a list of one reward per sample"
            )
        return answers[0]

    def _read(self, sample: Sample, answer: Any) -> tuple[float, dict[str, float], str | None, Any]:
        """A reward function's answer read as `_safe` returns it. A non-finite score (inf turned
        every loss of a run into NaN) is an error like a raised one."""
        try:
            kept = None
            if self.keep_answers:
                score, extras, kept = _read_if_reward(self.settings, answer)
            else:
                score, extras = read_reward(self.settings, answer)
            if not math.isfinite(score):
                raise ValueError(f"reward is {score}, not a finite number")
            if abs(score) > FLOAT32_MAX:  # finite here, inf in the float32 tensors advantages are computed in
                raise ValueError(f"reward is {score:g}, beyond float32's range (±{FLOAT32_MAX:.3g}): scale it down")
            return score, extras, None, kept
        except RewardSettingError:
            raise
        except Exception as e:
            return self._failed(sample, e)

    def _failed(self, sample: Sample, e: BaseException) -> tuple[float, dict[str, float], str, None]:
        """A failed reward: 0, "timeout" or "error"; the first failure of each exception type is logged,
        unless the run had closed its rewards under the sample (a plug-in's own worker thread that
        outlives the run, slime's fully-async example): the run's end, no fault to report."""
        timed_out = isinstance(e, (asyncio.TimeoutError, GradingTimeout))
        name = type(e).__name__
        detail = "no result in time, see --reward-timeout" if timed_out else str(e)
        counter = "rollout/reward_timeouts" if timed_out else "rollout/reward_errors"
        self.last_failure = f"{name}: {' '.join(detail.split())[:300]}"
        if name not in self._logged and not self.runner.closed:
            self._logged.add(name)
            log.warning(
                "reward of sample %d failed (%s: %s); it scores 0, further %s failures are only counted in %s",
                sample.index,
                name,
                detail,
                name,
                counter,
            )
        return 0.0, {}, "timeout" if timed_out else "error", None

    def close(self) -> None:
        self.runner.close()


async def score_samples(args, samples: list[Sample]) -> dict[str, float]:
    """Score `samples` with the run's rewards (`args.runtime.rewards`): the call for a rollout
    function, built-in or custom (see Rewards.score for what it sets and returns)."""
    rewards = getattr(getattr(args, "runtime", None), "rewards", None)
    if rewards is None:
        raise RuntimeError(
            "no rewards on args.runtime: score_samples runs inside a vime run (vime train), which builds them; elsewhere use Rewards(args).score"
        )
    return await rewards.score(samples)

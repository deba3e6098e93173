"""The data that flows from rollout to trainer.

A `Sample` is one prompt + one response. Groups of `--n-samples-per-prompt` samples share a
prompt and are the unit GRPO normalizes over, so rollout functions return `list[list[Sample]]`.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from vime.rollout.engine_stats import PrefixCacheInfo, SpecInfo

if TYPE_CHECKING:
    from torch import Tensor

MULTI_TURN_STATE = "multi_turn"  # metadata key of a multi-turn sample's state (vime.rollout.tools.multi_turn)


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # ended on a stop/eos token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # engine aborted it (pause/abort); partial tokens kept
    FAILED = "failed"  # engine error; never trained on


@dataclass
class Sample:
    index: int = 0
    group_index: int = 0
    prompt: str | list[dict[str, Any]] = ""
    # text, or the data's dict/list as it is (search-r1's {"ground_truth": ...}) for a custom reward
    label: str | dict[str, Any] | list[Any] | None = None
    tokens: list[int] = field(default_factory=list)  # prompt ids + response ids
    response_length: int = 0
    response: str = ""  # decoded response text (what rewards read)
    loss_mask: list[int] | None = None  # one per response token; None means all ones
    rollout_log_probs: list[float] | None = None  # one per response token
    weight_versions: list[int] | None = None  # one per response token
    # where in the response the generation a weight update may abort began (0, or a later turn's
    # start): a resumed one is searched from there for the stop string its engine could not see
    # across the cut (`generate.cut_at_stop`)
    generation_start: int = 0
    temperature: float | None = None  # what its response was drawn at, stamped by the generate that drew it
    reward: float | None = None
    reward_error: str | None = None  # "error" or "timeout" when the reward failed and 0 stood in for it
    # the reward's other numeric values (a dict reward's keys besides --reward-key), logged as
    # rollout/reward_<key> means
    reward_extras: dict[str, float] = field(default_factory=dict)
    # with --custom-reward-post-process-path: a reward function's answer that is no reward, as it
    # came (the OPD teacher's /generate answer), for the post-process to read (get_reward_value),
    # which drops it
    reward_result: Any = None
    # on-policy distillation with a served teacher (--opd-type sglang): the teacher's log-prob of
    # each response token, set by the post-process (vime/rollout/on_policy_distillation.py)
    teacher_log_probs: list[float] | None = None
    # a mixture of experts' routing as the engine ran it, for rollout routing replay (R3,
    # --use-rollout-routing-replay): int32 [positions, layers × top_k], row p the top-k expert ids
    # of each layer at position p of `tokens` (SGLang's `routed_experts`, decoded). At most
    # len(tokens) - 1 rows: the last token is never run. Each engine answer covers the sequence
    # from its start, so it replaces the rows (`take_routed_experts`)
    rollout_routed_experts: Tensor | None = None
    # set by a custom generate (vllm-project/vime's field): the sample stays in its group's reward
    # normalization but trains nothing, its loss mask zeroed before the step (`drop_removed`)
    remove_sample: bool = False
    # slime's multimodal fields, which vime keeps None (it rolls out text): slime's geo3k
    # multi-turn rollout reads and writes them whatever the model
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    # slime's routing key for its gateway's consistent hashing, which its generate (and the
    # plug-ins that copy it) reads; vime's client picks engines itself, so nothing sets it
    session_id: str | None = None
    # `Sample.Status.COMPLETED`, as vllm-project/vime's plug-ins spell it (docs/plugin-compat.md)
    Status: ClassVar[type[Status]] = Status
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    # slime's engine statistics (vime/rollout/engine_stats.py), `Sample.SpecInfo` as slime names them
    SpecInfo: ClassVar[type[SpecInfo]] = SpecInfo
    PrefixCacheInfo: ClassVar[type[PrefixCacheInfo]] = PrefixCacheInfo
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    # a generate of its own for this sample, in place of the run's, where slime's `generate_and_rm`
    # runs it (slime sets it from an eval data set's config; vime's copy honours it)
    generate_function_path: str | None = None
    # slime hands these to its Megatron loss as the batch's `metadata`; vime's loss takes no
    # per-sample extras, so they are kept and saved with the sample and train nothing
    train_metadata: dict[str, Any] | None = None
    # multi-teacher OPD's (MOPD, a slime fork's) log-probs by teacher domain; vime distils from one
    # teacher (`teacher_log_probs`), so these are kept and train nothing
    mopd_teacher_log_probs: dict[str, list[float]] | None = None

    def __post_init__(self) -> None:
        # slime's tau-bench builds its samples with the status's text (`Sample(status="completed")`)
        if isinstance(self.status, str) and not isinstance(self.status, Status):
            self.status = Status(self.status)
        # a sample read back from a dict (a checkpoint's, a saved rollout's) has its stats as dicts
        if isinstance(self.spec_info, dict):
            self.spec_info = SpecInfo.from_dict(self.spec_info)
        if isinstance(self.prefix_cache_info, dict):
            self.prefix_cache_info = PrefixCacheInfo.from_dict(self.prefix_cache_info)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def final_response(self) -> str:
        """What built-in rewards and eval grade: the response, or with --tools its last turn (a
        number in a tool's answer earlier in the conversation is not the model's answer)."""
        state = self.metadata.get(MULTI_TURN_STATE)
        return state.get("last_turn", self.response) if state else self.response

    def get_reward_value(self, args: Any) -> Any:
        """The reward as the reward function gave it (slime's method, which post-process functions
        call): the score, or an answer that is no reward kept for --custom-reward-post-process-path
        (a dict of it read at `--reward-key` when one is given)."""
        value = self.reward_result if self.reward_result is not None else self.reward
        key = args.reward_key
        return value[key] if key and isinstance(value, dict) else value

    def effective_loss_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * self.response_length

    @property
    def effective_response_length(self) -> int:
        """slime's name: the response tokens the loss sees (all of them without a loss mask)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def update_from_meta_info(self, args: Any, meta_info: dict[str, Any]) -> None:
        """slime's method, which generate functions written after slime's own call once they have
        extended `tokens`, `response_length` and `rollout_log_probs` by an engine answer: its
        `finish_reason` sets the status, and the response tokens that have no weight version yet
        (those the answer added) take the answer's (as `append_response_tokens` stamps them), so
        the per-token versions stay one per response token."""
        missing = self.response_length - len(self.weight_versions or [])
        if missing > 0 and (self.weight_versions is not None or missing == self.response_length):
            versions = _versions_of(meta_info, missing, args, None)
            self.weight_versions = None if versions is None else (self.weight_versions or []) + versions
        reason = meta_info.get("finish_reason")
        if reason is not None:  # an answer's end: its prompt tokens, as slime counts them
            self.prefix_cache_info.add(meta_info)
        reason = reason.get("type") if isinstance(reason, dict) else reason
        self.status = _FINISH_STATUS.get(reason, self.status)

    def to_dict(self) -> dict[str, Any]:
        """slime's: the sample's fields (and any a plug-in set) as a dict, the status as its text,
        for a plug-in that saves samples (from_dict reads it back)."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """slime's: a sample from `to_dict`'s dict; a key that is no field is set as an attribute."""
        fields = {f.name for f in dataclasses.fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in fields})
        for key, value in data.items():
            if key not in fields:
                setattr(sample, key, value)
        return sample

    def append_generated(
        self, ids: list[int], log_probs: list[float], versions: list[int], trainable: bool = True
    ) -> None:
        """Response tokens appended with everything that stays one per response token: their
        log-probs, weight versions and loss mask (an engine's answer; `trainable` False: tokens the
        model did not write, a tool's answer, out of the loss). New lists: a list the sample was
        handed with stays as it was. (vllm-project/vime's plug-ins call `append_response_tokens`.)"""
        n = len(ids)
        if not trainable or self.loss_mask is not None:
            self.loss_mask = self.effective_loss_mask() + [int(trainable)] * n
        self.tokens = self.tokens + list(ids)
        self.response_length += n
        self.rollout_log_probs = (self.rollout_log_probs or []) + list(log_probs)
        self.weight_versions = (self.weight_versions or []) + list(versions)

    def truncate_response(self, keep: int) -> None:
        """The response cut to its first `keep` tokens, every per-token list with it (the routing's
        rows with the positions cut)."""
        self.tokens = self.tokens[: self.prompt_length + keep]
        for name in ("loss_mask", "rollout_log_probs", "weight_versions"):
            values = getattr(self, name)
            if values is not None:
                setattr(self, name, values[:keep])
        self.response_length = keep
        if self.rollout_routed_experts is not None:
            self.rollout_routed_experts = self.rollout_routed_experts[: max(len(self.tokens) - 1, 0)]

    def take_routed_experts(self, meta: dict[str, Any]) -> None:
        """An engine answer's `routed_experts` (SGLang's: base64 of little-endian int32, one row per
        position from `routed_experts_start_len`, default 0, to the last token but one) in place
        of the rows from there on. An answer without them leaves the sample as it was."""
        routed = meta.get("routed_experts")
        if not routed:  # none asked, or an answer that ran no position
            return
        start = int(meta.get("routed_experts_start_len") or 0)
        rows = decode_routed_experts(routed, len(self.tokens) - 1 - start)
        if start:
            kept = self.rollout_routed_experts
            if kept is None or kept.shape[0] < start or kept.shape[1] != rows.shape[1]:
                raise ValueError(
                    f"an engine answer's routed experts start at position {start}, and the sample holds none "
                    "that match before it"
                )
            import torch

            rows = torch.cat([kept[:start], rows])
        self.rollout_routed_experts = rows

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens with everything that must stay in step with them:
        vllm-project/vime's method, which its multi-turn plug-ins call once per model turn (`trainable`,
        with the engine's log-probs) and once per tool answer (not trainable: loss mask 0,
        log-prob 0). `meta_info`'s `finish_reason` ("stop", "length", "abort", or {"type": ...})
        sets the status; its `weight_version` (or vime's per-token `output_weight_versions`, or
        the router's `weight_versions`: a choice passed whole)
        stamps the tokens, else the version the engines hold now (`args.runtime`), else the
        sample's versions become unknown (None) rather than wrong. `text` is added to `response`."""
        ids = [int(t) for t in (tokens if tokens is not None else [])]
        lps = None if log_probs is None else [float(x) for x in log_probs]
        if lps is not None and len(lps) != len(ids):
            raise ValueError(f"append_response_tokens: {len(lps)} log_probs for {len(ids)} tokens")
        if ids and trainable and lps is None:
            raise ValueError("append_response_tokens: trainable tokens need their rollout log_probs")
        if ids and not trainable:
            # zeros are what they get anyway: slime's geo3k multi-turn rollout passes them
            if lps is not None and any(lps):
                raise ValueError("append_response_tokens: tokens that are not trainable take no log_probs")
            lps = [0.0] * len(ids)
        meta = meta_info or {}
        before = self.response_length
        if text is not None:
            self.response += text
        if ids:
            if self.rollout_log_probs is None and before and trainable:
                raise ValueError(
                    "append_response_tokens: the sample has response tokens without rollout log-probs; "
                    "trainable tokens cannot be appended to it"
                )
            # in place where the lists line up: vllm-project/vime's plug-ins keep an alias (retool's
            # `loss_masks = sample.loss_mask`) and write it back when they finish
            self.tokens = _extended(self.tokens, None, ids)
            self.response_length += len(ids)
            self.loss_mask = _extended(self.loss_mask, before, [1 if trainable else 0] * len(ids), 1)
            self.rollout_log_probs = _extended(self.rollout_log_probs, before, lps or [], 0.0)
            versions = _versions_of(meta, len(ids), args, self.weight_versions if not trainable else None)
            if versions is None or (self.weight_versions is None and before):
                self.weight_versions = None
            else:
                self.weight_versions = (self.weight_versions or []) + versions
        self.take_routed_experts(meta)
        if update_terminal_info and "finish_reason" in meta:
            self.prefix_cache_info.add(meta)  # an answer's end: its prompt tokens, as slime counts them
            reason = meta["finish_reason"]
            reason = reason.get("type") if isinstance(reason, dict) else reason
            self.status = _FINISH_STATUS.get(reason, self.status)


def decode_routed_experts(value: str | bytes, positions: int) -> Tensor:
    """SGLang's `routed_experts` (base64 of little-endian int32 ids; raw bytes also taken) as an
    int32 tensor of `positions` rows: [positions, layers × top_k]."""
    import numpy as np
    import torch

    raw = base64.b64decode(value) if isinstance(value, str) else bytes(value)
    ids = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32))
    if positions <= 0 or ids.numel() % positions:
        raise ValueError(
            f"an engine answer's routed experts hold {ids.numel()} ids, which do not split into the "
            f"{max(positions, 0)} positions it ran"
        )
    return ids.reshape(positions, -1)


def _extended(values: list | None, length: int | None, more: list, fill: Any = None) -> list:
    """`values` (cut or padded with `fill` to `length` when given) followed by `more`: the same
    list object when it is a list already of that length, else a new one."""
    if isinstance(values, list) and (length is None or len(values) == length):
        values.extend(more)
        return values
    if length is None:
        return list(values or []) + more
    have = list(values or [])[:length]
    return have + [fill] * (length - len(have)) + more


_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def _versions_of(meta: dict[str, Any], n: int, args: Any, earlier: list[int] | None) -> list[int] | None:
    """The policy version of each of `n` appended tokens (see append_response_tokens), or None
    when nothing says it. `earlier`: a tool answer's tokens take the last version before them."""
    per_token = meta.get("output_weight_versions", meta.get("weight_versions"))  # the engine's; the router's choice
    if isinstance(per_token, list) and len(per_token) == n:
        return [int(v) for v in per_token]
    version = meta.get("weight_version")
    if version is None and earlier:
        version = earlier[-1]
    if version is None:
        version = getattr(getattr(args, "runtime", None), "engine_version", None)
    try:
        return None if version is None else [int(version)] * n
    except (TypeError, ValueError):  # a version that is not a number (another engine's naming)
        return None


@dataclass
class RolloutOutput:
    samples: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


def drop_removed(groups: list[list[Sample]]) -> int:
    """Zero the loss mask of every sample marked `remove_sample`, as vllm-project/vime does when it turns
    samples into training data: such a sample adds nothing to the loss or its gradient, while
    its reward still counts in its group's mean and std (vllm-project/vime normalizes over the whole
    group too). Returns how many were marked."""
    removed = 0
    for s in (s for g in groups for s in g if s.remove_sample):
        s.loss_mask = [0] * s.response_length
        removed += 1
    return removed


def holds_groups(out: Any) -> bool:
    """What the train loop reads of a rollout function's answer: `.samples`, non-empty groups
    of Samples (slime's RolloutFnTrainOutput has the same two fields), and `.metrics`."""
    groups = getattr(out, "samples", None)
    return (
        isinstance(groups, list)
        and isinstance(getattr(out, "metrics", None), dict)
        and all(isinstance(g, list) and g and all(isinstance(s, Sample) for s in g) for g in groups)
    )


def flatten(results: list[Sample | list[Sample]]) -> list[Sample]:
    """A group's generate results as one group: a list a generate returned (several samples for
    one, an agent's turns say) stands for its samples, each trained in the group of its prompt."""
    return [s for r in results for s in (r if isinstance(r, list) else [r])]

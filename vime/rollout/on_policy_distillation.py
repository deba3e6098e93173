"""On-policy distillation with a teacher served by an engine (`--use-opd --opd-type sglang`, or
`vllm`: opd_vllm.py; the teacher's client: opd_teacher.py): slime's `slime.rollout.on_policy_distillation`, whose path loads this module.

    vime serve --model-path TEACHER --port 30010 &
    vime train ... --use-opd --opd-type sglang --rm-url http://127.0.0.1:30010/generate \\
        --custom-rm-path vime.rollout.on_policy_distillation.reward_func \\
        --custom-reward-post-process-path vime.rollout.on_policy_distillation.post_process_rewards

`reward_func` sends each sample's prompt + response tokens to the teacher's `/generate` with
nothing to generate (`max_new_tokens: 0`) and `logprob_start_len` at the response's first token:
SGLang's scoring request, which a vime engine answers too (engine/core/scoring.py), so the teacher
scores exactly the tokens the student drew, and only those. Its answer is the sample's reward
answer. The calls go through vime's reward runner: all of a group's at once, at most 64 open per
teacher, each retried while the teacher is busy (a vime engine answers 503 while its KV cache is
full) or down until `--reward-timeout`. One that still fails scores 0, counts in
`rollout/reward_errors` (a teacher down; `rollout/reward_timeouts` a teacher busy throughout), and
its sample trains without the teacher's term, as a failed reward costs a reward, not the run; a
teacher that fails every sample for `--max-failed-reward-steps` steps in a row stops the run
(rewards/watch.py). An answer with a log-prob above 0 (a probability above 1) is an error of its
sample.
What no retry can mend stops the run in one line (`TeacherError`): a teacher of another vocabulary
(its `/get_model_info`, asked once, where it says; a table padded to another size is the same
vocabulary: models.table_fits), a refusal (a 4xx: a wrong key or path, a
sequence longer than the teacher's context), an answer that is not a scoring of the tokens sent.

`post_process_rewards` stores the teacher's log-prob of each response token on its sample
(`Sample.teacher_log_probs`, which the trainer reads: algorithms/opd.py) and returns 0 as every
sample's reward, as slime's does: the run distills. To mix in a task reward, call it from a
post-process of your own and return the task's rewards instead.
"""

from __future__ import annotations

from typing import Any

from vime.plugins import PluginError
from vime.rollout.opd_teacher import Teacher
from vime.rollout.opd_vllm import VLLMTeacher
from vime.rollout.settings import RolloutConfig
from vime.rollout.types import Sample, Status

_TEACHERS: dict[tuple[str, str, float, str | None], Teacher] = {}


def teacher_of(rollout: RolloutConfig, kind: str | None) -> Teacher:
    """The process's one teacher for the run's --opd-type (`kind`: sglang when not given) and
    --rm-url (its connection limit and checks shared by every sample)."""
    kind = kind or "sglang"
    model_dir = rollout.model_dir
    key = (kind, rollout.rm_url, float(rollout.reward_timeout), str(model_dir) if model_dir else None)
    if key not in _TEACHERS:
        cls = VLLMTeacher if kind == "vllm" else Teacher
        _TEACHERS[key] = cls(rollout.rm_url, float(rollout.reward_timeout), key[3])
    return _TEACHERS[key]


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """`--custom-rm-path`: the teacher's answer to the scoring request of `sample`'s response tokens
    (a sample without any asks nothing)."""
    if sample.response_length == 0:
        return {}  # nothing to score: the post-process reads no answer for it
    return await teacher_of(args.rollout, args.algorithm.opd_type).score(sample)


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """`--custom-reward-post-process-path`: each sample's `teacher_log_probs` from the teacher's
    answer (None where its reward failed: it trains without the teacher's term), and 0 as every
    sample's reward, raw and trained (slime's pair)."""
    teacher = teacher_of(args.rollout, args.algorithm.opd_type)
    for s in samples:
        answer = s.reward_result
        if answer is None:
            s.teacher_log_probs = None
        else:
            s.teacher_log_probs = teacher.log_probs(answer, s) if s.response_length else []
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)


def check_served(samples: list[Any], post_process: str) -> None:
    """A served teacher (`--opd-type sglang` or `vllm`), once the post-process ran: every sample whose reward (the teacher's
    answer) came has the teacher's log-prob of each response token; one line otherwise, naming
    the sample, before anything is trained on it."""
    for s in samples:
        scores = s.teacher_log_probs
        if scores is None and (s.reward_error is not None or s.status == Status.FAILED):
            continue  # the teacher was not reached: counted in rollout/reward_errors, trained without it
        if scores is None or len(scores) != s.response_length:
            what = "no" if scores is None else f"{len(scores)}"
            raise PluginError(
                f"--custom-reward-post-process-path {post_process} left sample {s.index} with {what} teacher log-probs "
                f"for its {s.response_length} response tokens: a served teacher's run trains on sample.teacher_log_probs, "
                "one per response token (vime.rollout.on_policy_distillation.post_process_rewards sets them)"
            )

"""A reward function written slime's way for a mixed-domain data set (as slime users write one
for --custom-rm-path): it picks a rule by the sample's `metadata["domain"]` and calls slime's
rule helpers at their modules' paths (`rm_hub.deepscaler`, `rm_hub.gpqa`, `rm_hub.math_utils`)
or slime's `remote_rm` for a reward model behind HTTP. For
tests/unit/compat/test_slime_rm_hub_modules.py in that API, not copied."""

from slime.rollout.rm_hub import remote_rm
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.gpqa import compute_gpqa_reward
from slime.rollout.rm_hub.math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy
from slime.utils.types import Sample


async def reward_func(args, sample: Sample, **kwargs) -> float:
    domain = (sample.metadata or {}).get("domain")
    if domain == "math":
        return float(get_deepscaler_rule_based_reward(sample.response, sample.label))
    if domain == "boxed":
        given = extract_answer(sample.response) or ""
        return float(grade_answer_mathd(given, sample.label) or grade_answer_sympy(given, sample.label))
    if domain == "choice":
        return compute_gpqa_reward(sample.response, sample.label, metadata=sample.metadata)
    return (await remote_rm(args, sample))["score"]

"""A QA reward written slime's way for --custom-rm-path: the word-overlap F1 of the response's
answer (after its last "Answer:", or the whole response) against the label, from
`slime.rollout.rm_hub.f1`, as a search-r1-style multi-hop QA run scores partly right answers.
For tests/unit/compat/test_slime_rm_f1.py, in slime's API, not copied."""

from slime.rollout.rm_hub.f1 import f1_score
from slime.utils.types import Sample


def answer_of(response: str) -> str:
    return response.rsplit("Answer:", 1)[-1]


async def reward_func(args, sample: Sample, **kwargs) -> float:
    return float(f1_score(answer_of(sample.response), str(sample.label))[0])

"""Custom generates that decide about their own samples, as vllm-project/vime's agents do (tau-bench's
sets the reward from its environment; others mark a sample `remove_sample`), for
tests/unit/rollout/test_own_verdicts.py. Each runs vime's generate first, so a tiny random model serves."""

from vime.rollout.generate import generate as default_generate
from vime.rollout.types import Sample

# shaped as vllm-project/vime's tau-bench reward: a success above 1 (with a bonus), a failure's bonus
# alone; no grader gives either, so a sample that keeps one was scored by the generate alone
SOLVED, BONUS_ONLY = 1.5, 0.15


async def parity_scored(args, sample: Sample, sampling_params) -> Sample:
    """SOLVED when the response's first token id is even, else BONUS_ONLY; a row whose metadata
    says `grade` is left unscored, for eval to grade against its label."""
    sample = await default_generate(args, sample, sampling_params)
    if not sample.metadata.get("grade"):
        first = sample.response_tokens[:1]
        sample.reward = SOLVED if first and first[0] % 2 == 0 else BONUS_ONLY
    return sample


async def removes_even_indices(args, sample: Sample, sampling_params) -> Sample:
    sample = await default_generate(args, sample, sampling_params)
    sample.remove_sample = sample.index % 2 == 0
    return sample


async def removes_all(args, sample: Sample, sampling_params) -> Sample:
    sample = await default_generate(args, sample, sampling_params)
    sample.remove_sample = True
    return sample

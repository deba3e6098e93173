"""A mixture of experts' routing on the rollout side (R3, issue 70): the default generate asks the
engine for it (SGLang's `return_routed_experts`) and the sample keeps it (`rollout_routed_experts`),
in step with its tokens when cut, through slime's `append_response_tokens`, saved rollouts, the
rollout process's pickles and a re-queue; an engine that does not answer it stops the run."""

from __future__ import annotations

import asyncio
import base64
import pickle
import re

import numpy as np
import pytest
import torch

from unit.rollout.test_sampling_flags import FakeClient, with_runtime
from vime.config import Config
from vime.errors import EngineError
from vime.rollout.generate import generate, sampling_params
from vime.rollout.types import Sample, Status, decode_routed_experts

LAYERS_K = 4  # 2 layers × top-2


def wire(ids: np.ndarray) -> str:
    """SGLang's routed_experts: base64 of the little-endian int32 ids."""
    return base64.b64encode(ids.astype("<i4").tobytes()).decode()


class RoutingClient(FakeClient):
    """Answers as FakeClient, plus each position's experts (position p routed to p % 7 + layer)
    when asked; `answers` False: an engine that ignores the field."""

    def __init__(self, answers: bool = True):
        super().__init__()
        self.answers, self.asked = answers, []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, return_routed_experts=False):
        self.asked.append(return_routed_experts)
        out = await super().generate(input_ids, sampling_params, return_logprob, rid)
        if return_routed_experts and self.answers:
            positions = len(input_ids) + len(out["output_ids"]) - 1
            out["meta_info"]["routed_experts"] = wire(expected(positions))
        return out


def expected(positions: int) -> np.ndarray:
    return (np.arange(positions)[:, None] % 7 + np.arange(LAYERS_K)[None, :]).astype(np.int32)


def test_the_default_generate_asks_and_keeps_the_routing_of_every_position_run():
    client = RoutingClient()
    args = with_runtime(Config(rollout_max_response_len=5, use_rollout_routing_replay=True), client)
    sample = asyncio.run(generate(args, Sample(index=0, tokens=[40, 41, 42]), sampling_params(args)))
    assert client.asked == [True] and sample.response_length == 5
    assert sample.rollout_routed_experts.dtype == torch.int32
    assert np.array_equal(sample.rollout_routed_experts.numpy(), expected(3 + 5 - 1))
    plain = RoutingClient()
    asyncio.run(
        generate(with_runtime(Config(rollout_max_response_len=5), plain), Sample(tokens=[40]), {"max_new_tokens": 2})
    )
    assert plain.asked == [False]  # not asked for unless a setting reads it


def test_an_engine_that_does_not_answer_the_routing_stops_the_run():
    args = with_runtime(Config(rollout_max_response_len=5, record_routed_experts=True), RoutingClient(answers=False))
    with pytest.raises(EngineError, match="an engine answered without routed_experts"):
        asyncio.run(generate(args, Sample(index=0, tokens=[40, 41]), sampling_params(args)))


def test_a_cut_response_cuts_its_routing_and_a_resumed_answer_replaces_it():
    sample = Sample(tokens=[1, 2, 3], response_length=0)
    sample.append_generated([4, 5, 6, 7], [-1.0] * 4, [0] * 4)
    sample.take_routed_experts({"routed_experts": wire(expected(6))})
    sample.truncate_response(2)  # tokens 1 2 3 4 5: positions 0..3 ran a token that stays
    assert np.array_equal(sample.rollout_routed_experts.numpy(), expected(6)[:4])
    # an answer from position 3 on (SGLang's routed_experts_start_len) keeps the rows before it
    sample.append_generated([8], [-1.0], [0])
    later = expected(9)[3:5] + 100  # positions 3 and 4 of the 6 tokens
    sample.take_routed_experts({"routed_experts": wire(later), "routed_experts_start_len": 3})
    assert np.array_equal(sample.rollout_routed_experts.numpy(), np.concatenate([expected(6)[:3], later]))
    with pytest.raises(ValueError, match="hold 5 ids, which do not split into the 3 positions"):
        decode_routed_experts(wire(np.arange(5)), 3)


def test_the_upstream_append_response_tokens_keeps_the_routing_it_is_handed():
    """A custom generate of slime's kind passes the engine's meta_info along, routed experts in it."""
    sample = Sample(tokens=[1, 2], response_length=0)
    meta = {"finish_reason": {"type": "stop"}, "weight_version": 3, "routed_experts": wire(expected(3))}
    sample.append_response_tokens(None, tokens=[5, 6], log_probs=[-0.5, -0.5], meta_info=meta)
    assert sample.status == Status.COMPLETED and sample.rollout_routed_experts.shape == (3, LAYERS_K)


def test_the_routing_survives_a_saved_rollout_a_pickle_and_goes_with_a_requeue(tmp_path):
    from vime.debug_rollout import check_sample, load_rollout, save_rollout
    from vime.rollout.data.source import _fresh
    from vime.rollout.types import RolloutOutput

    sample = Sample(index=0, group_index=0, tokens=[1, 2, 3, 4], response_length=2, status=Status.COMPLETED)
    sample.rollout_routed_experts = torch.from_numpy(expected(3))
    template = str(tmp_path / "r{rollout_id}.pt")
    save_rollout(template, 0, RolloutOutput([[sample]]))
    back = load_rollout(template, 0, n_per_prompt=1).samples[0][0]
    assert torch.equal(back.rollout_routed_experts, sample.rollout_routed_experts)
    assert torch.equal(pickle.loads(pickle.dumps(sample)).rollout_routed_experts, sample.rollout_routed_experts)
    assert _fresh(sample).rollout_routed_experts is None
    sample.rollout_routed_experts = torch.zeros(4, LAYERS_K, dtype=torch.int32)  # one row past the last token run
    assert "has rollout_routed_experts [4, 4] for 4 tokens: expected at most 3 rows" in check_sample(sample, None)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--use-rollout-routing-replay", "--rollout-backend", "vllm"],
            "--use-rollout-routing-replay: vime's vLLM adapter does not read routed experts",
        ),
        (["--moe-aux-loss-coeff", "-0.1"], "--moe-aux-loss-coeff -0.1 must be >= 0"),
        (
            ["--expert-model-parallel-size", "2", "--device", "cpu", "--actor-num-procs", "4"],
            "--expert-model-parallel-size 2: vime splits the experts over all of the trainer's 4 rank(s)",
        ),
    ],
)
def test_moe_settings_refused_from_the_settings_alone(flags, message):
    from vime.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1", *flags])

"""slime's sampling flags on the rollout side: eval sampling settings, stop strings in the
request, and --rollout-max-context-len per sample (fresh, resumed, and in the fully-async
worker), against a fake engine client that records what it is asked."""

from __future__ import annotations

import asyncio
import json

import pytest

from vime.config import Config
from vime.models import make_tiny_tokenizer
from vime.rollout.generate import generate, sampling_params
from vime.rollout.types import Sample, Status


class FakeClient:
    """Answers every request with `max_new_tokens` tokens (id 40, finish reason length), or
    `cap` tokens when fewer (finish reason abort), and records each request's params."""

    def __init__(self, cap: int | None = None):
        self.url = "fake://engine"
        self.cap = cap
        self.requests: list[tuple[int, dict]] = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None):
        self.requests.append((len(input_ids), dict(sampling_params)))
        n = sampling_params["max_new_tokens"]
        aborted = self.cap is not None and self.cap < n
        n = self.cap if aborted else n
        return {
            "output_ids": [40] * n,
            "meta_info": {
                "finish_reason": {"type": "abort" if aborted else "length"},
                "output_token_logprobs": [-1.0] * n,
                "output_weight_versions": [0] * n,
            },
        }

    def abort_request(self, rid=None, abort_all=False):
        return {"success": True}

    async def close(self):
        pass


def with_runtime(args: Config, client: FakeClient) -> Config:
    from vime.rollout.rewards import Rewards
    from vime.rollout.runtime import RolloutRuntime

    args.runtime = RolloutRuntime((client,), make_tiny_tokenizer(), rewards=Rewards(args))
    return args


# ---- sampling params ---------------------------------------------------------------------


def test_eval_sampling_defaults_and_overrides():
    base = dict(rollout_temperature=0.8, rollout_top_p=0.9, rollout_top_k=20, eval_max_response_len=64)
    p = sampling_params(Config(**base), evaluation=True)
    assert (p["temperature"], p["top_p"], p["top_k"], p["max_new_tokens"]) == (0.0, 1.0, -1, 64)  # greedy
    p = sampling_params(Config(**base, n_samples_per_eval_prompt=4), evaluation=True)
    assert (p["temperature"], p["top_p"], p["top_k"]) == (0.8, 0.9, 20)  # the rollout's settings
    p = sampling_params(Config(**base, eval_temperature=0.6), evaluation=True)
    assert (p["temperature"], p["top_p"], p["top_k"]) == (0.6, 0.9, 20)
    p = sampling_params(Config(**base, eval_temperature=0.6, eval_top_p=0.7), evaluation=True)
    assert (p["temperature"], p["top_p"]) == (0.6, 0.7)
    p = sampling_params(Config(**base, n_samples_per_eval_prompt=4, eval_temperature=0.0), evaluation=True)
    assert (p["temperature"], p["top_p"], p["top_k"]) == (0.0, 1.0, -1)
    p = sampling_params(Config(**base, eval_top_p=0.5), evaluation=True)
    assert (p["temperature"], p["top_p"]) == (0.0, 0.5)  # an explicit top-p stands even when greedy
    train = sampling_params(Config(**base))
    assert (train["temperature"], train["top_p"], train["top_k"]) == (0.8, 0.9, 20)


def test_stop_strings_are_sent_only_when_given():
    assert "stop" not in sampling_params(Config()) and "stop" not in sampling_params(Config(), evaluation=True)
    args = Config(rollout_stop=["</answer>", "\n\n"])
    assert sampling_params(args)["stop"] == ["</answer>", "\n\n"]
    assert sampling_params(args, evaluation=True)["stop"] == ["</answer>", "\n\n"]  # eval ends responses alike


def test_the_eval_loop_uses_the_eval_settings(tmp_path):
    from vime.eval import _run

    client = FakeClient()
    args = with_runtime(Config(eval_max_response_len=3, eval_temperature=0.5, eval_top_p=0.6), client)
    asyncio.run(_run(args, [Sample(index=0, tokens=[40, 41])], step=0))
    assert [(p["temperature"], p["top_p"]) for _, p in client.requests] == [(0.5, 0.6)]


# ---- --rollout-max-context-len -----------------------------------------------------------------


def test_max_context_len_caps_each_samples_response():
    client = FakeClient()
    args = with_runtime(Config(rollout_max_response_len=10, rollout_max_context_len=12), client)
    params = sampling_params(args)
    short = asyncio.run(generate(args, Sample(index=0, tokens=[40] * 5), params))
    long = asyncio.run(generate(args, Sample(index=1, tokens=[40] * 9), params))
    assert [p["max_new_tokens"] for _, p in client.requests] == [7, 3]  # 12 - the prompt
    assert (short.response_length, len(short.tokens), short.status) == (7, 12, Status.TRUNCATED)
    assert (long.response_length, len(long.tokens)) == (3, 12)
    # the response budget still applies when the context leaves more
    roomy = asyncio.run(generate(args, Sample(index=2, tokens=[40]), params))
    assert roomy.response_length == 10
    # no room at all: truncated, no request
    n = len(client.requests)
    full = asyncio.run(generate(args, Sample(index=3, tokens=[40] * 12), params))
    assert (full.status, full.response_length, len(client.requests)) == (Status.TRUNCATED, 0, n)
    # without the flag: the response budget only
    free = with_runtime(Config(rollout_max_response_len=10), FakeClient())
    assert asyncio.run(generate(free, Sample(index=4, tokens=[40] * 9), sampling_params(free))).response_length == 10


def test_max_context_len_caps_a_resumed_partial_sample():
    client = FakeClient()
    args = with_runtime(Config(rollout_max_response_len=10, rollout_max_context_len=12), client)
    # an aborted sample holding 4 tokens of its response after a 5-token prompt: 3 left by the context
    partial = Sample(index=0, tokens=[40] * 9, response_length=4, rollout_log_probs=[-1.0] * 4, weight_versions=[0] * 4)
    partial.status = Status.ABORTED
    out = asyncio.run(generate(args, partial, sampling_params(args)))
    sent, params = client.requests[-1]
    assert (sent, params["max_new_tokens"]) == (9, 3)  # prompt + partial response sent, 3 more asked for
    assert (out.response_length, len(out.tokens), len(out.rollout_log_probs)) == (7, 12, 7)
    # with a context that leaves more, the response budget (10 in all) is what is left: 6
    roomy = with_runtime(Config(rollout_max_response_len=10, rollout_max_context_len=100), FakeClient())
    partial = Sample(index=0, tokens=[40] * 9, response_length=4, rollout_log_probs=[-1.0] * 4, weight_versions=[0] * 4)
    assert asyncio.run(generate(roomy, partial, sampling_params(roomy))).response_length == 10


def test_fully_async_worker_caps_responses_by_the_context(tmp_path):
    from vime.rollout.data.source import DataSource
    from vime.rollout.fully_async_rollout import generate_rollout_fully_async

    data = tmp_path / "d.jsonl"
    # prompts of 3, 5 and 9 tokens (one per character); 9 leaves no room in 9 and is left out
    data.write_text("".join(json.dumps({"input": "q" * n, "label": "1"}) + "\n" for n in (3, 5, 9)))
    client = FakeClient(cap=2)  # every request aborted after 2 tokens: --partial-rollout resumes them
    args = Config(
        prompt_data=str(data),
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        rollout_max_response_len=10,
        rollout_max_context_len=9,
        update_in_flight="resume",  # --partial-rollout, as Config.validate spells it
        custom_rm_path="varied_reward:constant",
    )
    with_runtime(args, client)
    ds = DataSource(args, args.runtime.tokenizer)
    assert ds.skipped_prompts == 1
    try:
        out = generate_rollout_fully_async(args, 0, ds)
    finally:
        args.runtime.close()
    samples = [s for g in out.samples for s in g]
    # prompts of 3 and 5 tokens: responses of 6 and 4 (the response budget of 10 would allow more)
    assert all(len(s.tokens) == 9 and s.response_length == 9 - len(s.prompt) for s in samples)
    assert all(s.status == Status.TRUNCATED and len(s.rollout_log_probs) == s.response_length for s in samples)
    # every request asked for at most what the context left
    assert all(prompt_len + p["max_new_tokens"] <= 9 for prompt_len, p in client.requests)
    assert out.metrics["rollout/resumed"] > 0


@pytest.mark.parametrize("flag", ["rollout_max_prompt_len", "rollout_max_context_len"])
def test_skipped_prompts_reach_the_counter(tmp_path, flag):
    from vime.rollout.data.source import DataSource

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": "q" * n, "label": "1"}) + "\n" for n in (3, 5, 9)))
    ds = DataSource(Config(prompt_data=str(data), **{flag: 6}), make_tiny_tokenizer())
    assert (len(ds), ds.skipped_prompts) == (2, 1)

"""slime's on-policy distillation example with `vime serve` standing in for its SGLang teacher:
the script waits on the server's `/health_generate` (it had only `/health`, so the script's wait
never ended), and the example's reward, posting the sample's ids with `max_new_tokens` 0 and
`logprob_start_len` 0, gets each token's log-prob in `meta_info.input_token_logprobs`, which
the post-process turns into the response's teacher log-probs (tests/plugins/slime_opd_plugins.py)."""

from __future__ import annotations

import asyncio
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from slime_opd_plugins import post_process_rewards, reward_func
from transformers import AutoModelForCausalLM

from vime.backends.builtin.launch import launch_engine
from vime.rollout.types import Sample


@pytest.fixture(scope="module")
def teacher(tiny_model, tmp_path_factory):
    proc = launch_engine(
        str(tiny_model), extra_args=["--num-threads", "1"], log_path=tmp_path_factory.mktemp("t") / "log"
    )
    yield proc
    proc.shutdown()


def test_the_teacher_answers_the_route_slimes_script_waits_on(teacher):
    with urllib.request.urlopen(f"{teacher.url}/health_generate", timeout=30) as r:
        assert r.status == 200


def test_slimes_opd_reward_gets_the_teachers_log_prob_of_each_response_token(teacher, tiny_model):
    prompt, response = [5, 17, 42, 8], [11, 23, 7]
    sample = Sample(prompt="p", tokens=prompt + response, response_length=len(response), index=0)
    args = SimpleNamespace(rm_url=f"{teacher.url}/generate", reward_key=None)
    sample.reward = asyncio.run(reward_func(args, sample))
    rewards, _ = post_process_rewards(args, [sample])
    assert rewards == [0.0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
    expected = torch.stack([logits[i - 1, t] for i, t in enumerate(prompt + response)][len(prompt) :])
    assert torch.allclose(sample.teacher_log_probs, expected, atol=1e-4)

"""slime's on-policy distillation example with `vime serve` standing in for its SGLang teacher:
the script waits on the server's `/health_generate` (it had only `/health`, so the script's wait
never ended), and the example's reward, posting the sample's ids with `max_new_tokens` 0 and
`logprob_start_len` 0, gets each token's log-prob in `meta_info.input_token_logprobs`, which
the post-process turns into the response's teacher log-probs (tests/plugins/slime_opd_plugins.py).
The script's `--advantage-estimator on_policy_distillation` (slime's earlier OPD, which vime
refused as an invalid choice) is vime's served-teacher OPD over GRPO."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli
from slime_opd_plugins import post_process_rewards, reward_func, reward_func_text
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


def test_a_text_prompt_is_tokenized_and_answered_with_text_as_sglang_does(teacher, tiny_model):
    """The example's earlier reward posts `text` (the prompt and response): `vime serve` took
    `input_ids` only ("missing field 'input_ids'")."""
    from vime.models import load_tokenizer

    tok = load_tokenizer(tiny_model)
    sample = Sample(prompt="1+1=", response="2", index=0)
    args = SimpleNamespace(rm_url=f"{teacher.url}/generate", reward_key=None)
    answer = asyncio.run(reward_func_text(args, sample))
    ids = tok.encode("1+1=2")
    assert [item[1] for item in answer["meta_info"]["input_token_logprobs"]] == ids
    assert answer["text"] == "" and answer["output_ids"] == []  # max_new_tokens 0: scored, nothing generated
    said = urllib.request.Request(
        f"{teacher.url}/generate",
        data=json.dumps(
            {"text": "1+1=", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(said, timeout=30) as r:
        out = json.loads(r.read())
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True) and len(out["output_ids"]) == 3


def test_an_ids_prompt_is_answered_with_text_too_and_the_rollouts_client_asks_for_none(teacher, tiny_model):
    """SGLang answers every /generate with text: a plug-in posting `input_ids` to a `vime serve`
    and reading `text` got a KeyError. vime's own client decodes the ids itself and asks for none."""
    from vime.backends.client import EngineClient
    from vime.models import load_tokenizer

    tok = load_tokenizer(tiny_model)
    body = {"input_ids": tok.encode("1+1="), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    req = urllib.request.Request(
        f"{teacher.url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        out = json.loads(r.read())
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True) and out["output_ids"]

    async def ours() -> dict:
        client = EngineClient(teacher.url)
        try:
            return await client.generate(body["input_ids"], body["sampling_params"])
        finally:
            await client.close()

    mine = asyncio.run(ours())
    assert "text" not in mine and mine["output_ids"] == out["output_ids"]


def test_slimes_opd_script_flags_train_against_the_teacher(teacher, tmp_path):
    """examples/on_policy_distillation/run-qwen3-8B-opd.sh's GRPO_ARGS and RM_ARGS, the plug-ins
    in the example's shape, on the tiny model: every sample is scored by the teacher and trained
    with its term."""
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "2", "--runs-dir", str(tmp_path),
        "--run-name", "r",
        "--advantage-estimator", "on_policy_distillation", "--use-kl-loss", "--kl-loss-coef", "0.00",
        "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00",
        "--custom-rm-path", "slime_opd_plugins.reward_func",
        "--custom-reward-post-process-path", "slime_opd_plugins.post_process_rewards",
        "--rm-url", f"{teacher.url}/generate",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--advantage-estimator on_policy_distillation → --advantage-estimator grpo --use-opd --opd-type sglang" in (
        res.stderr
    )
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(r["rollout/reward_errors"] == 0 and r["train/opd_unscored_samples"] == 0 for r in rows)
    assert all("train/opd_reverse_kl" in r for r in rows)

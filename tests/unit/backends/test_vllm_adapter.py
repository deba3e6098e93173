"""The vLLM backend's translation, no server (these run everywhere): sampling params key by key,
per-request seeds, stop strings, the server's command line and the user's vLLM args (those the
adapter relies on refused), the CPU server's defaults, and the supported versions. The backend
against real servers: test_vllm_server.py and test_vllm_push.py; whole runs,
tests/e2e/test_vllm_runs.py."""

from __future__ import annotations

import asyncio

import pytest

from vime.backends.client import EngineError
from vime.backends.vllm.client import VLLMClient, check_version, from_vllm_choice, request_seed, to_vllm_sampling_params
from vime.backends.vllm.launch import merge_vllm_args, server_command

# ---- translation (no server) ----------------------------------------------------------------


def test_sampling_params_are_mapped_key_by_key():
    out = to_vllm_sampling_params(
        {
            "max_new_tokens": 5,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "stop_token_ids": [3],
            "ignore_eos": True,
            "n": 2,
            "sampling_seed": 11,
        }
    )
    assert out == {
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "stop_token_ids": [3],
        "ignore_eos": True,
        "n": 2,
        "seed": 11,
        "logprobs": 0,
        "detokenize": False,
    }
    assert to_vllm_sampling_params({})["max_tokens"] == 128  # the built-in engine's default, not vLLM's
    penalties = {"min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5}  # vLLM's own names
    assert to_vllm_sampling_params(penalties).items() >= penalties.items()
    with pytest.raises(EngineError, match=r"unsupported sampling_params \['max_tokens', 'min_new_tokens'\]"):
        to_vllm_sampling_params({"max_tokens": 5, "min_new_tokens": 1})


def test_each_request_of_a_sample_gets_its_own_seed_and_the_same_one_again():
    """vLLM restarts a request's generator from its seed: a resumed request or a next turn of
    one sample, seeded alike, would redraw the first request's noise token by token. Each prompt
    length of a sample gets its own seed, the same one every time (runs stay reproducible), and
    other samples' seeds stay apart; all within vLLM's int range."""
    seeds = {n: request_seed(11, n) for n in range(1, 400)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(request_seed(11, n) == s for n, s in seeds.items())
    assert request_seed(12, 30) not in (seeds[30], request_seed(11, 31))
    assert all(0 <= s < 2**31 for s in seeds.values())
    # and the client sends it (the body read where it would leave for the server)
    sent: list[dict] = []

    async def record(route: str, body: dict) -> None:
        sent.append(body)
        raise EngineError("recorded")

    client = VLLMClient("http://127.0.0.1:9")
    client.apost = record
    for ids in ([1, 2, 3], [1, 2, 3, 4, 5]):
        with pytest.raises(EngineError, match="recorded"):
            asyncio.run(client.generate(ids, {"max_new_tokens": 4, "sampling_seed": 11}))
    assert [b["sampling_params"]["seed"] for b in sent] == [request_seed(11, 3), request_seed(11, 5)]


def test_stop_strings_are_matched_on_text_and_kept():
    out = to_vllm_sampling_params({"max_new_tokens": 5, "stop": ["</answer>", "##"]})
    assert out == {
        "max_tokens": 5,
        "stop": ["</answer>", "##"],
        "logprobs": 0,
        "detokenize": True,  # vLLM refuses stop strings without detokenizing
        "include_stop_str_in_output": True,  # the string ends the response and stays in it, as in vime's engine
    }
    assert to_vllm_sampling_params({"stop": "##"})["stop"] == ["##"]
    assert to_vllm_sampling_params({"stop": []}) == {"max_tokens": 128, "logprobs": 0, "detokenize": False}


EXTENSION = (
    *("--worker-extension-cls", "vime.backends.vllm.worker_ext.WeightReceiver"),
    *("--middleware", "vime.backends.vllm.worker_ext.require_api_key"),
)


def command_flags(cmd: list[str]) -> list[str]:
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return cmd[3:]


def test_server_command_takes_the_users_vllm_args():
    own = command_flags(server_command("/m", port=9, device="cuda:0", dtype="bfloat16", max_num_seqs=8, seed=3))
    assert own == [
        *("--model", "/m", "--host", "127.0.0.1", "--port", "9", "--enable-scale-out"),
        *("--logprobs-mode", "processed_logprobs", *EXTENSION),
        *("--dtype", "bfloat16", "--max-num-seqs", "8", "--seed", "3"),
    ]
    tp = command_flags(server_command("/m", port=9, device="cuda:0", tp_size=2))
    assert tp[tp.index("--tensor-parallel-size") + 1] == "2"
    cmd = command_flags(
        server_command(
            "/m",
            port=9,
            device="cpu",
            extra_args=["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"],
            vllm_args={
                "gpu-memory-utilization": "0.55",  # vime's value for a shared GPU: the user's wins
                "max_num_seqs": "64",  # vLLM reads _ and - alike: still vime's --max-num-seqs, replaced
                "enforce-eager": True,  # a bare switch
                "enable-prefix-caching": False,  # vLLM's --no- form
                "kv-cache-memory-bytes": "123",  # vime's CPU default, replaced
                "served-model-name": ["a", "b"],  # several values
                "enable-sleep-mode": True,  # what vime passes already: not twice
                "logprobs-mode": "processed_logprobs",
                "max_model_len": "4096",  # on CPU also the step's token budget (prompts kept whole)
            },
        )
    )
    assert cmd == [
        *("--model", "/m", "--host", "127.0.0.1", "--port", "9", "--enable-scale-out"),
        *("--logprobs-mode", "processed_logprobs", *EXTENSION),
        *("--dtype", "float32", "--max-num-seqs", "64", "--seed", "0"),
        *("--enable-sleep-mode", "--gpu-memory-utilization", "0.55", "--kv-cache-memory-bytes", "123"),
        *("--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"),
        *("--enforce-eager", "--no-enable-prefix-caching", "--served-model-name", "a", "b", "--max-model-len", "4096"),
    ]
    for flag in ("gpu-memory-utilization", "max-num-seqs", "seed", "dtype", "enable-sleep-mode", "logprobs-mode"):
        assert cmd.count(f"--{flag}") <= 1, flag


@pytest.mark.parametrize(
    "name, value, shown",
    [
        ("port", "8000", "--port 9"),
        ("host", "0.0.0.0", "--host 127.0.0.1"),
        ("model", "/other", "--model /m"),
        ("logprobs-mode", "raw_logprobs", "--logprobs-mode processed_logprobs"),
        ("enable_scale_out", False, "--enable-scale-out"),
        ("no-enable-sleep-mode", True, "--enable-sleep-mode"),
        ("worker-extension-cls", "my.Ext", "--worker-extension-cls vime.backends.vllm.worker_ext.WeightReceiver"),
        ("middleware", "my.mw", "--middleware vime.backends.vllm.worker_ext.require_api_key"),
    ],
)
def test_vllm_args_that_the_adapter_relies_on_are_refused(name, value, shown):
    from vime.config import ConfigError

    with pytest.raises(ConfigError) as e:
        server_command("/m", port=9, device="cuda:0", extra_args=["--enable-sleep-mode"], vllm_args={name: value})
    msg = str(e.value)
    assert msg == f"--vllm-{name}: vime starts its vLLM servers with {shown} and relies on it: drop --vllm-{name}"


def test_a_cpu_server_keeps_prompts_whole_unless_told_otherwise(tiny_model):
    """vLLM's CPU sampler dies on a seeded request whose prefill was split over steps, so a CPU
    server never splits one: the step's budget is the model's context (512 here; 2048 at
    least). The user's --vllm-enable-chunked-prefill replaces vime's switch, in one form."""
    cpu = command_flags(server_command(str(tiny_model), port=9, device="cpu"))
    assert cpu[-3:] == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]
    mine = command_flags(server_command(str(tiny_model), port=9, vllm_args={"enable-chunked-prefill": True}))
    assert "--enable-chunked-prefill" in mine and "--no-enable-chunked-prefill" not in mine
    gpu = command_flags(server_command(str(tiny_model), port=9, device="cuda:0"))
    assert not any("chunked" in f or "batched" in f for f in gpu)


def test_a_cpu_server_runs_eager_unless_told_how_to_compile(tiny_model):
    """On CPU vLLM compiled the model again at every start (its compile cache did not load), so
    vime starts it eager; a compile flag of the user's, in either form, is the user's choice."""
    cpu = command_flags(server_command(str(tiny_model), port=9, device="cpu"))
    assert cpu.count("--enforce-eager") == 1
    for given, shown in (
        ({"enforce-eager": False}, "--no-enforce-eager"),
        ({"no_enforce_eager": True}, "--no-enforce-eager"),
        ({"compilation-config": '{"mode": 3}'}, "--compilation-config"),
    ):
        mine = command_flags(server_command(str(tiny_model), port=9, device="cpu", vllm_args=given))
        assert "--enforce-eager" not in mine and shown in mine, given
    gpu = command_flags(server_command(str(tiny_model), port=9, device="cuda:0"))
    assert not any("eager" in f for f in gpu)


def test_vllm_args_merge_keeps_vimes_own_when_none_are_given():
    assert merge_vllm_args(["--seed", "1"], {}) == ["--seed", "1"]


def test_unsupported_versions_are_refused_in_one_line():
    check_version("0.32.0", "u")
    check_version("0.32.3+cpu", "u")
    for v in ("0.31.2", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(EngineError, match=r"version .* supports >=0.32,<0.33") as e:
            check_version(v, "http://h:1")
        assert "\n" not in str(e.value)


def test_choice_translation_expands_version_spans():
    choice = {
        "index": 0,
        "finish_reason": "abort",
        "token_ids": [7, 8, 9],
        "weight_versions": [{"version": "default", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
        "logprobs": {"content": [{"token_id": t, "logprob": -float(t)} for t in (7, 8, 9)]},
    }
    out = from_vllm_choice(choice, {"usage": {"prompt_tokens": 5}}, "r", True, "u")
    assert out == {
        "output_ids": [7, 8, 9],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "abort"},
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "weight_version": 4,
            "output_weight_versions": [0, 4, 4],
            "output_token_logprobs": [-7.0, -8.0, -9.0],
        },
    }
    with pytest.raises(EngineError, match="'error'"):
        from_vllm_choice(dict(choice, finish_reason="error"), {"usage": {"prompt_tokens": 5}}, "r", True, "u")

"""slime's SGLang plug-in interface (docs/plugin-compat.md): the router's SGLang-native routes,
checked against the shapes SGLang itself gives, and runs whose custom generate is written slime's
way (tests/slime_sglang_plugins.py) against a real engine.

SGLang's shapes, as its code builds them (sgl-project/sglang, python/sglang/srt/):
* request, `managers/io_struct.py` GenerateReqInput: `text` (str, or a list for a batch) or
  `input_ids` (ids, or a list of them), `sampling_params` (a dict, or one per prompt),
  `return_logprob`, `logprob_start_len`, `rid` (a batch's string is a prefix: `rid_0`, ...),
  `stream`; sampling params `sampling/sampling_params.py` (max_new_tokens 128 by default,
  skip_special_tokens True, no_stop_trim False, ...).
* answer, `managers/tokenizer_manager.py`: `{text, output_ids, meta_info}`, a list for a batch;
  meta_info `id`, `finish_reason` (`schedule_batch.py` FINISH_*.to_json: `{type: stop, matched:
  token id | string}`, `{type: length, length}`, `{type: abort, message}`), `prompt_tokens`,
  `completion_tokens`, `cached_tokens`, `weight_version` (the server's, a string), `e2e_latency`; with
  return_logprob `output_token_logprobs` as `(logprob, token_id, None)` (`detokenize_logprob_tokens`)
  and `input_token_logprobs` from logprob_start_len, None for the first prompt token.
* text: `detokenizer_manager.py` trim_matched_stop: a matched stop string cut from the text (kept
  with no_stop_trim), a matched stop token left out of it; output_ids keep every token.
* errors: `http_server.py` `{"error": {"message": ...}}` with 400; /abort_request `{rid,
  abort_all}` answered 200 with an empty body; /health 200.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli, train_here
from safetensors.torch import load_file

KEY = "router-key-for-tests"
META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency"}


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """A real engine, the rollout runtime over it and the router in front, behind a key."""
    from transformers import AutoTokenizer

    from vime.backends.builtin.launch import launch_engine
    from vime.backends.client import EngineClient
    from vime.compat.router import Router
    from vime.rollout.runtime import RolloutRuntime

    args = ["--num-threads", "1", "--block-size", "4", "--max-num-batched-tokens", "32", "--seed", "0"]
    engine = launch_engine(str(tiny_model), extra_args=args, log_path=tmp_path_factory.mktemp("logs") / "engine.log")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    runtime = RolloutRuntime([EngineClient(engine.url)], tokenizer)
    router = Router(runtime, 16, model_path=str(tiny_model), api_key=KEY).start()
    yield router, engine, tokenizer
    router.stop()
    runtime.close()
    engine.shutdown()


def call(router, path: str, body: Any = None, key: str | None = KEY) -> tuple[int, Any]:
    """One request to the router as any HTTP client sends it: (status, JSON body or text)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{router.host}:{router.port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def generate(router, body: dict) -> Any:
    status, out = call(router, "/generate", body)
    assert status == 200, out
    return out


def engine_answer(engine, ids: list[int], params: dict) -> dict:
    """The engine's own answer to the same request, for comparison."""
    from vime.backends.client import EngineClient

    client = EngineClient(engine.url)

    async def main() -> dict:
        try:
            return await client.generate(ids, params)
        finally:
            await client.close()

    return asyncio.run(main())


def assert_sglang_answer(out: dict, prompt_len: int, logprobs: bool) -> None:
    assert set(out) >= {"text", "output_ids", "meta_info"} and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert set(meta) >= META, META - set(meta)
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["prompt_tokens"] == prompt_len and meta["completion_tokens"] == len(out["output_ids"])
    assert isinstance(meta["weight_version"], str) and isinstance(meta["e2e_latency"], float)
    if logprobs:
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == out["output_ids"]
        assert all(len(t) == 3 and isinstance(t[0], float) and t[2] is None for t in triples)
    else:
        assert "output_token_logprobs" not in meta


# ---- the routes, against SGLang's shapes -----------------------------------------------


def test_generate_by_input_ids_is_the_engines_answer_in_sglangs_shape(served):
    router, engine, _ = served
    ids = [40, 41, 42, 43]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = generate(router, {"input_ids": ids, "sampling_params": params, "return_logprob": True})
    assert_sglang_answer(out, len(ids), logprobs=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    own = engine_answer(engine, ids, params)
    assert out["output_ids"] == own["output_ids"]
    assert [t[0] for t in out["meta_info"]["output_token_logprobs"]] == pytest.approx(
        own["meta_info"]["output_token_logprobs"], abs=1e-6
    )
    assert out["meta_info"]["weight_version"] == "0"


def test_text_is_tokenized_and_the_answer_decoded_as_sglang_does(served):
    router, _, tokenizer = served
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    out = generate(router, {"text": "12+3=", "sampling_params": params})
    ids = tokenizer.encode("12+3=")  # with the tokenizer's special tokens, as SGLang tokenizes text
    assert_sglang_answer(out, len(ids), logprobs=False)
    assert out["output_ids"] == generate(router, {"input_ids": ids, "sampling_params": params})["output_ids"]
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    kept = generate(router, {"text": "12+3=", "sampling_params": dict(params, skip_special_tokens=False)})
    assert kept["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=False)


def test_a_batch_is_answered_in_order_with_a_list(served):
    router, _, tokenizer = served
    texts = ["1+1=", "2+2=", "3+3="]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (1, 2, 3)]
    outs = generate(
        router, {"text": texts, "sampling_params": params, "return_logprob": [True, False, True], "rid": "b"}
    )
    assert isinstance(outs, list) and len(outs) == 3
    for i, out in enumerate(outs):
        assert_sglang_answer(out, len(tokenizer.encode(texts[i])), logprobs=i != 1)
        assert len(out["output_ids"]) == i + 1 and out["meta_info"]["id"] == f"b_{i}"
    by_ids = generate(router, {"input_ids": [tokenizer.encode(t) for t in texts], "sampling_params": params})
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in outs]
    one = generate(router, {"input_ids": [tokenizer.encode(texts[0])], "sampling_params": params[0]})
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still a batch
    many = generate(router, {"text": texts[0], "sampling_params": {"max_new_tokens": 3, "n": 2}})
    assert isinstance(many, list) and len(many) == 2  # one prompt, n samples


def test_a_stop_string_or_token_ends_the_answer_and_its_text_as_sglang_cuts_it(served):
    router, _, tokenizer = served
    prompt = [50, 51, 52]
    free = generate(
        router, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    )
    text = free["text"]
    k = next(k for k in range(2, len(text) - 1) if text.find(text[k : k + 2]) == k and text[k : k + 2].strip())
    stop = text[k : k + 2]
    for trim, want in ((False, text[:k]), (True, text[: k + 2])):
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop], "no_stop_trim": trim}
        out = generate(router, {"input_ids": prompt, "sampling_params": params})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["text"] == want
        assert tokenizer.decode(out["output_ids"], skip_special_tokens=True).endswith(stop)  # ids keep it
    first = free["output_ids"][0]
    for trim, want in ((False, ""), (True, tokenizer.decode([first], skip_special_tokens=True))):
        params = {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [first], "no_stop_trim": trim}
        out = generate(router, {"input_ids": prompt, "sampling_params": params})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
        assert out["output_ids"] == [first] and out["text"] == want


def test_prompt_log_probs_from_logprob_start_len(served):
    router, engine, _ = served
    ids = [60, 61, 62, 63, 64]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    whole = generate(router, {**body, "logprob_start_len": 0})["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in whole] == ids and whole[0][0] is None and all(isinstance(t[0], float) for t in whole[1:])
    tail = generate(router, {**body, "logprob_start_len": 2})["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in tail] == ids[2:]
    assert [t[0] for t in tail] == pytest.approx([t[0] for t in whole[2:]], abs=1e-5)
    assert "input_token_logprobs" not in generate(router, body)["meta_info"]  # not asked: not scored


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"text": "1+1=", "sampling_params": {"min_new_tokens": 3}}, "min_new_tokens"),
        ({"text": "1+1=", "sampling_params": {"temperatur": 0.3}}, "temperatur"),
        ({"text": "1+1=", "image_data": ["x.png"]}, "image_data"),
        ({"sampling_params": {}}, "text or input_ids"),
        ({"input_ids": [1, 2], "text": "a"}, "text or input_ids"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params is a list of 1 for 2 prompts"),
    ],
)
def test_a_request_vime_cannot_serve_is_answered_400_naming_why(served, body, says):
    status, out = call(served[0], "/generate", body)
    assert status == 400 and says in out["error"]["message"], out


def test_the_sglang_defaults_are_taken_silently(served):
    params = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0, "regex": None}
    out = generate(served[0], {"text": "1+1=", "sampling_params": {**params, "max_new_tokens": 2}})
    assert len(out["output_ids"]) <= 2
    assert len(generate(served[0], {"text": "1+1=", "sampling_params": {"ignore_eos": True}})["output_ids"]) == 128


def test_min_p_reaches_the_engine(served):
    """SGLang's min_p is the engine's own now: 1 keeps only the likeliest token, so sampling at
    temperature 1 gives the greedy answer."""
    ids = [70, 71, 72]
    greedy = generate(served[0], {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
    params = {"max_new_tokens": 8, "temperature": 1.0, "min_p": 1.0, "sampling_seed": 3}
    assert generate(served[0], {"input_ids": ids, "sampling_params": params})["output_ids"] == greedy["output_ids"]


def generated_tokens(engine) -> float:
    """The engine's count of tokens generated so far (its /metrics)."""
    text = urllib.request.urlopen(engine.url + "/metrics", timeout=10).read().decode()
    return float(re.search(r"^vime_engine_generated_tokens_total (\S+)$", text, re.M).group(1))


def test_abort_request_ends_the_request_with_the_tokens_it_had(served):
    router, engine, _ = served
    for body in ({"rid": "long"}, {"abort_all": True}):
        before = generated_tokens(engine)
        answer: dict[str, Any] = {}
        params = {"max_new_tokens": 480, "ignore_eos": True}
        req = {"input_ids": [70, 71, 72], "sampling_params": params, "return_logprob": True, "rid": "long"}
        t = threading.Thread(target=lambda req=req, answer=answer: answer.update(out=call(router, "/generate", req)))
        t.start()
        deadline = time.monotonic() + 30
        while generated_tokens(engine) < before + 5:
            assert time.monotonic() < deadline, "the engine made no progress"
            time.sleep(0.005)
        assert call(router, "/abort_request", body) == (200, "")
        t.join(30)
        status, out = answer["out"]
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out
        assert 5 <= out["meta_info"]["completion_tokens"] < 480
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    assert call(router, "/abort_request", {"rid": "nothing-in-flight"}) == (200, "")


def test_the_key_is_wanted_everywhere_but_health_and_sent_by_the_plugins_post(served):
    router = served[0]
    body = {"text": "1+1=", "sampling_params": {"max_new_tokens": 1}}
    status, out = call(router, "/generate", body, key=None)
    assert status == 401 and "--api-key" in out["error"]
    assert call(router, "/generate", body, key="wrong")[0] == 401
    assert call(router, "/abort_request", {"abort_all": True}, key=None)[0] == 401
    assert call(router, "/health", key=None) == (200, {"status": "ok"})

    from slime.utils.http_utils import close_sessions, post  # a plug-in's post(): the run's key goes with it

    async def main() -> Any:
        try:
            return await post(f"http://{router.host}:{router.port}/generate", body)
        finally:
            await close_sessions()

    assert asyncio.run(main())["meta_info"]["completion_tokens"] == 1


def test_health_generate_model_info_flush_cache_and_stream(served):
    router, _, tokenizer = served
    assert call(router, "/health_generate") == (200, "")
    status, info = call(router, "/get_model_info")
    assert status == 200 and info["is_generation"] is True and info["weight_version"] == "0" and info["model_path"]
    assert call(router, "/flush_cache")[0] == 200
    status, text = call(router, "/generate", {"text": "1+1=", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert_sglang_answer(last, len(tokenizer.encode("1+1=")), logprobs=False)


# ---- runs whose custom generate is written slime's way ----------------------------------

ROWS = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(4) for b in range(3)]
FULLY_ASYNC = ("--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def run_steps(tmp_path: Path, data: Path, tiny_model: Path, generate: str, *extra: str) -> list[dict]:
    """Two steps of the tiny model whose custom generate is `generate`; the metrics rows of its steps."""
    train_here(
        "train_async.py" if FULLY_ASYNC[1] in extra else "train.py",
        "--hf-checkpoint", str(tiny_model), "--prompt-data", str(data),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--num-rollout", "2", "--lr", "1e-2", "--max-tokens-per-gpu", "512",
        "--custom-generate-function-path", f"slime_sglang_plugins.{generate}",
        "--custom-rm-path", "slime_sglang_plugins.response_parity",
        "--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"),
        *extra,
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def assert_trained(tmp_path: Path, tiny_model: Path) -> None:
    trained = load_file(next((tmp_path / "ckpt").glob("*/model.safetensors")))
    start = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start)


@pytest.mark.parametrize(
    ("generate", "per_prompt"),
    [
        ("generate_with_tool", 2),
        ("generate_with_search", 2),
        ("generate_best_of_two", 2),
        ("generate_env_turns", 2),
        ("generate_agents", 6),
    ],
)
def test_a_slime_style_generate_trains_through_the_routers_generate(generate, per_prompt, tmp_path, data, tiny_model):
    """Sync: every sample its generate built from the router's SGLang answers is trained."""
    steps = run_steps(tmp_path, data, tiny_model, generate)
    assert len(steps) == 2
    assert all(r["rollout/num_samples"] == 2 * per_prompt for r in steps)
    assert any(r["train/grad_norm"] > 0 for r in steps)
    assert_trained(tmp_path, tiny_model)


def test_a_scripts_sglang_server_concurrency_reaches_the_plugins_args(tmp_path, data, tiny_model):
    """slime's default is 512 (generate_with_search checks it); a script's own value is what a
    plug-in sizing its client pool by it (strands-sglang) reads."""
    steps = run_steps(tmp_path, data, tiny_model, "generate_with_a_pool_of_seven", "--sglang-server-concurrency", "7")
    assert len(steps) == 2


@pytest.mark.parametrize("generate", ["generate_with_tool", "generate_agents"])
def test_the_router_keeps_log_probs_and_weight_versions_for_the_async_modes(generate, tmp_path, data, tiny_model):
    """Fully-async (slime's rollout path): its off-policy correction needs every response token's
    rollout log-prob, and the staleness metrics its weight version. The tool plug-in appends them
    from `output_token_logprobs` and `meta_info`; the agents drop them, and the router gives them back."""
    steps = run_steps(tmp_path, data, tiny_model, generate, *FULLY_ASYNC)
    assert len(steps) == 2
    assert all("rollout/staleness_mean" in r for r in steps)
    assert_trained(tmp_path, tiny_model)


@pytest.mark.parametrize(
    ("generate", "says"),
    [
        ("generate_agents_refused", "the router refused"),
        ("generate_agents_broken", "what it printed or logged above"),
    ],
)
def test_a_generate_that_hides_its_failures_is_named_with_the_cause(generate, says, tmp_path, data, tiny_model):
    """multi_agent's agents catch their own errors: when every call fails it returns an empty
    list, and the run says why (the router's refusal it hid, or where to look) in one line."""
    res = run_cli(
        "train.py", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(data),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--custom-generate-function-path", f"slime_sglang_plugins.{generate}",
        "--custom-rm-path", "slime_sglang_plugins.response_parity",
        "--runs-dir", str(tmp_path), "--num-rollout", "1",
        timeout=300,
    )  # fmt: skip
    assert res.returncode != 0
    line = next(ln for ln in res.stderr.splitlines() if "returned an empty list" in ln)
    assert says in line and "Traceback" not in res.stderr
    if generate == "generate_agents_refused":
        assert "min_new_tokens" in line  # the refusal itself
        assert "Error generating response" in res.stdout  # what the plug-in printed


def test_generate_state_and_the_rollout_names_are_slimes():
    from types import SimpleNamespace

    import slime.rollout.sglang_rollout as sr

    from vime.config import Config
    from vime.plugin_args import PluginArgs

    for name in ("generate", "generate_and_rm", "generate_and_rm_group", "generate_rollout_async", "eval_rollout"):
        assert asyncio.iscoroutinefunction(getattr(sr, name)), name
    cfg = Config(rollout_max_response_len=7, rollout_stop=["</a>"]).freeze()
    assert sr.slime_sampling_params(PluginArgs(cfg, None)) == {
        "temperature": cfg.rollout_temperature,
        "top_p": cfg.rollout_top_p,
        "top_k": cfg.rollout_top_k,
        "max_new_tokens": 7,
        "stop": ["</a>"],
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    router = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=9)
    assert sr.get_model_url(router, "ref") == "http://127.0.0.1:9/generate"


def test_a_sample_built_with_the_status_text_has_the_status():
    """slime's tau-bench builds `Sample(status="completed")` (the enum's value): the sample keeps
    the enum, which vime's filters and metrics compare with; a text that is no status fails."""
    from slime.utils.types import Sample

    sample = Sample(status="truncated")
    assert sample.status is Sample.Status.TRUNCATED
    assert Sample().status is Sample.Status.PENDING
    with pytest.raises(ValueError, match="finished"):
        Sample(status="finished")

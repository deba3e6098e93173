"""`vime serve` as an OpenAI-compatible server, through the official `openai` client against real
engine processes: a random tiny model (its template shows no tools), and a tiny model trained to
call an `add` tool through a Qwen-like chat template (tests/plugins/tool_model.py).

Where vLLM does the same, the same test runs against a vLLM server started as its users start
one (`vllm serve`-style flags: hermes tool parser, raw log-probs, its default; no vime extension):
marked `vllm`, run by `make test-vllm`, skipped where vllm is not installed. What only vime
answers (its refusals, its metrics) checks the vime server alone.

Models: random Qwen3s with head_dim 32 (vLLM's CPU attention refuses the default tiny model's 16).
Tolerance: log-probs must match a teacher-forced HF forward within ATOL = 1e-4 (float32 on CPU,
as tests/unit/engine/test_server.py); the engine answers them from its own scoring of prompt and answer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch

from unit.engine.reference import hf_greedy
from vime.backends.builtin.launch import launch_engine

ATOL = 1e-4
NAME = "tiny-served"  # --served-model-name
TOOL_NAME = "tiny-adder"
KEY = "test-key"
LONG = {"max_tokens": 480, "extra_body": {"ignore_eos": True}}  # a request that runs for a while
SHAPE32 = dict(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
HAS_VLLM = importlib.util.find_spec("vllm") is not None
BACKENDS = [
    "vime",
    pytest.param(
        "vllm",
        marks=[pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed: make test-vllm")],
    ),
]


# ---- servers -------------------------------------------------------------------------------


@dataclass
class Server:
    backend: str  # vime | vllm
    url: str
    stop: Callable[[], None]

    def only_vime(self, why: str) -> None:
        if self.backend != "vime":
            pytest.skip(f"vime's own: {why}")


def vllm_server(model: Path, name: str, log: Path, key: str | None) -> Server:
    """A vLLM server as its users start one (no vime extension), on CPU: eager, a small KV cache,
    prompts never split (vime/backends/vllm/launch.py says why, for seeded requests on CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", name, "--dtype", "float32", "--max-model-len", "512",
           "--seed", "0", "--enforce-eager", "--kv-cache-memory-bytes", str(1 << 28), "--no-enable-chunked-prefill",
           "--max-num-batched-tokens", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--exclude-tools-when-tool-choice-none", *(["--api-key", key] if key else [])]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return Server("vllm", url, stop)
        except (urllib.error.URLError, ConnectionError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                stop()
                raise AssertionError(f"vLLM did not start: {log.read_text()[-3000:]}") from None
            time.sleep(1)


def serve(backend: str, model: Path, name: str, log: Path, key: str | None = None) -> Server:
    if backend == "vllm":
        return vllm_server(model, name, log, key)
    args = ["--num-threads", "1", "--served-model-name", name, "--seed", "0"]
    proc = launch_engine(str(model), extra_args=args, log_path=log, api_key=key)
    return Server("vime", proc.url, proc.shutdown)


@pytest.fixture(scope="module")
def model32(tmp_path_factory) -> Path:
    from vime.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny32") / "qwen3", seed=0, **SHAPE32)


@pytest.fixture(scope="module", params=BACKENDS)
def plain(request, model32, tmp_path_factory):
    server = serve(request.param, model32, NAME, tmp_path_factory.mktemp("logs") / "plain.log")
    yield server
    server.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def tooled(request, tmp_path_factory):
    from tool_model import chat_tool_model

    log = tmp_path_factory.mktemp("logs") / "tooled.log"
    server = serve(request.param, chat_tool_model(**SHAPE32), TOOL_NAME, log, key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(plain) -> openai.OpenAI:
    return openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tool_client(tooled) -> openai.OpenAI:
    return openai.OpenAI(base_url=tooled.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf(model32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model32, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model32):
    from vime.models import load_tokenizer

    return load_tokenizer(model32)


def chat(client: openai.OpenAI, content: str = "hi", **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}], **kw)


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    rows = (ln.split() for ln in text.splitlines() if ln and not ln.startswith("#"))
    return {name.removeprefix("vime_engine_"): float(value) for name, value in rows}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


@torch.no_grad()
def hf_table(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p the raw (temperature-free) log-probs of the token at p given ids[:p]
    (row 0 is nothing: no token predicts the first)."""
    lps = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return torch.cat([torch.full_like(lps[:1], float("nan")), lps[:-1]])


def hf_logprobs(hf, ids: list[int], start: int) -> list[float]:
    table = hf_table(hf, ids)
    return [float(table[p, ids[p]]) for p in range(start, len(ids))]


def check_top(server: Server, tok, row: torch.Tensor, listed: dict[str, float], k: int) -> None:
    """A position's listed alternatives: each one's log-prob is HF's; vime lists exactly the k
    likeliest. (vLLM lists the first k of its dict, which begins with the drawn token, so a
    drawn token outside the k likeliest displaces the k-th.)"""
    for token, logprob in listed.items():
        assert logprob == pytest.approx(float(row[tok.convert_tokens_to_ids(token)]), abs=ATOL)
    if server.backend == "vime":
        best = row.topk(k)
        assert len(listed) == k and sorted(listed.values(), reverse=True) == pytest.approx(
            best.values.tolist(), abs=ATOL
        )
        assert list(listed.values()) == sorted(listed.values(), reverse=True)


# ---- the surface a client meets first -------------------------------------------------------


def test_models_lists_the_served_model_and_its_context(client, plain, model32):
    (card,) = client.models.list().data
    assert card.id == NAME and card.max_model_len == 512
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    plain.only_vime("GET /v1/models/{name} (vLLM has no such route), the directory as a name")
    assert client.models.retrieve(NAME).id == NAME and card.owned_by == "vime"
    assert client.models.retrieve(str(model32)).id == str(model32)
    with pytest.raises(
        openai.NotFoundError, match="model 'gpt-4o' is not served here: this engine serves 'tiny-served'"
    ):
        client.models.retrieve("gpt-4o")


def test_streamed_text_is_the_answers_text_for_the_same_seed(client):
    for n in (1, 3):
        whole = chat(client, max_tokens=24, n=n, seed=11)
        parts = [""] * n
        finish, usage = [None] * n, None
        for chunk in chat(client, max_tokens=24, n=n, seed=11, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                parts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
        assert parts == [c.message.content for c in whole.choices]
        assert finish == [c.finish_reason for c in whole.choices]
        assert usage == whole.usage
    texts = ["", ""]
    for chunk in client.completions.create(model=NAME, prompt="12+", max_tokens=20, n=2, seed=5, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [
        c.text for c in client.completions.create(model=NAME, prompt="12+", max_tokens=20, n=2, seed=5).choices
    ]


def test_min_p_one_keeps_only_the_likeliest_token(client):
    """vLLM's min_p (extra_body): at 1 only the likeliest token survives, so sampling at
    temperature 1 answers what greedy does."""
    greedy = chat(client, max_tokens=8, temperature=0).choices[0].message.content
    kept = chat(client, max_tokens=8, temperature=1.0, seed=5, extra_body={"min_p": 1.0}).choices[0].message.content
    assert kept == greedy != chat(client, max_tokens=8, temperature=1.0, seed=5).choices[0].message.content


def test_presence_and_frequency_penalties_are_hfs_greedy_with_them(client, hf, tok):
    """OpenAI's penalties (on the answer's tokens, as vLLM applies them), greedy: HF's greedy
    with each token's logit less frequency times its count in the answer and presence if there."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    for presence, frequency in ((1.5, 0.0), (0.0, 0.8)):
        kw = {"presence_penalty": presence, "frequency_penalty": frequency, "extra_body": {"ignore_eos": True}}
        out = chat(client, max_tokens=10, temperature=0, **kw).choices[0].message.content
        reference = hf_greedy(hf, ids, 10, presence=presence, frequency=frequency)
        assert out == tok.decode(reference, skip_special_tokens=True)


def test_a_seed_reproduces_at_temperature_one_and_another_seed_differs(client):
    answers = {chat(client, max_tokens=20, temperature=1.0, seed=7).choices[0].message.content for _ in range(3)}
    assert len(answers) == 1
    assert chat(client, max_tokens=20, temperature=1.0, seed=8).choices[0].message.content not in answers


@pytest.mark.parametrize("as_ids", [False, True])
def test_list_prompts_each_get_n_choices_as_if_asked_alone(client, tok, as_ids):
    prompts = ["1+2=", "hello", "abc"]
    if as_ids:
        prompts = [tok.encode(p, add_special_tokens=False) for p in prompts]
    kw = {"max_tokens": 8, "n": 2, "seed": 3, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(model=NAME, prompt=prompts, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=NAME, prompt=prompt, **kw)
        assert [c.text for c in out.choices[2 * p : 2 * p + 2]] == [c.text for c in alone.choices]
    assert out.usage.prompt_tokens == 4 + 5 + 3 and out.usage.completion_tokens == 6 * 8


# ---- log-probs ------------------------------------------------------------------------------


def test_chat_logprobs_are_the_models_raw_log_probs_with_the_likeliest_tokens(client, plain, hf, tok):
    kw = {"max_tokens": 12, "temperature": 0.7, "seed": 2, "extra_body": {"ignore_eos": True}}
    out = chat(client, logprobs=True, top_logprobs=3, **kw).choices[0]
    entries = out.logprobs.content
    assert "".join(e.token for e in entries) == out.message.content and len(entries) == 12
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    table = hf_table(hf, ids + tok.encode(out.message.content, add_special_tokens=False))
    for p, e in enumerate(entries, start=len(ids)):
        assert e.logprob == pytest.approx(float(table[p, tok.convert_tokens_to_ids(e.token)]), abs=ATOL)
        check_top(plain, tok, table[p], {t.token: t.logprob for t in e.top_logprobs}, 3)
    greedy = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1).choices[0]
    assert all(e.top_logprobs[0].token == e.token for e in greedy.logprobs.content)


def test_echo_with_logprobs_scores_the_prompt_too(client, plain, hf, tok):
    kw = {"max_tokens": 5, "echo": True, "logprobs": 2, "seed": 1, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(model=NAME, prompt="3+4=", **kw).choices[0]
    lp = out.logprobs
    assert out.text.startswith("3+4=") and "".join(lp.tokens) == out.text and len(lp.tokens) == 4 + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset == list(range(9))
    table = hf_table(hf, tok.encode(out.text, add_special_tokens=False))
    for p in range(1, 9):
        assert lp.token_logprobs[p] == pytest.approx(float(table[p, tok.convert_tokens_to_ids(lp.tokens[p])]), abs=ATOL)
        listed = dict(lp.top_logprobs[p])
        if plain.backend == "vllm" and len(listed) == 3:  # vLLM adds the token itself to its two likeliest
            listed.pop(lp.tokens[p])
        check_top(plain, tok, table[p], listed, 2)
    # echo alone, nothing generated: what lm-eval-harness asks to score a text
    scored = client.completions.create(model=NAME, prompt="3+4=7", max_tokens=0, echo=True, logprobs=0).choices[0]
    assert scored.text == "3+4=7" and scored.logprobs.token_logprobs[1:] == pytest.approx(
        hf_logprobs(hf, tok.encode("3+4=7", add_special_tokens=False), 1), abs=ATOL
    )


def test_streamed_logprobs_join_to_the_answers_for_the_same_seed(client):
    """Each choice's log-probs arrive in its chunks (vime: all in its last text chunk, once
    scored), and join to what the answer without stream has, as clients join them."""
    kw = {"max_tokens": 6, "seed": 3, "n": 2, "logprobs": True, "top_logprobs": 2}
    whole = chat(client, **kw)
    joined: list[list] = [[], []]
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            joined[c.index] += c.logprobs.content if c.logprobs else []
    assert joined == [c.logprobs.content for c in whole.choices] and all(len(j) > 0 for j in joined)
    kw = {"model": NAME, "prompt": "ab", "max_tokens": 4, "seed": 3, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    tokens, lps = [], []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            lps += chunk.choices[0].logprobs.token_logprobs
    answer = client.completions.create(**kw).choices[0].logprobs
    assert (tokens, lps) == (answer.tokens, answer.token_logprobs) and len(tokens) == 4


# ---- stops and logit_bias -------------------------------------------------------------------


def test_stop_strings_and_stop_ids_end_the_text_before_them(client, tok):
    def complete(stream: bool = False, **kw):
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        out = client.completions.create(
            model=NAME, prompt="a", max_tokens=30, temperature=0, stream=stream, extra_body=extra, **kw
        )
        return "".join(c.choices[0].text for c in out) if stream else out

    text = complete().choices[0].text
    at = next(i for i in range(3, 20) if text.find(text[i : i + 2]) == i)  # a 2-character stop first seen at i
    stop = text[at : at + 2]
    out = complete(stop=[stop, "never"])
    assert out.choices[0].text == text[:at] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 30  # the engine stopped there, not the text after it
    assert complete(stop=stop, extra_body={"include_stop_str_in_output": True}).choices[0].text == text[: at + 2]
    assert complete(stream=True, stop=stop) == text[:at]
    stop_id = tok.convert_tokens_to_ids(text[at])
    by_id = complete(extra_body={"stop_token_ids": [stop_id]}).choices[0]
    assert by_id.text == text[: text.index(text[at])] and by_id.finish_reason == "stop"


def test_logit_bias_bans_a_token_and_forces_another(client, tok):
    text = chat(client, max_tokens=6, temperature=0).choices[0].message.content
    first = tok.convert_tokens_to_ids(text[0])
    banned = chat(client, max_tokens=6, temperature=0, logit_bias={str(first): -100}).choices[0].message.content
    assert banned[0] != text[0]
    z = tok.convert_tokens_to_ids("z")
    assert (
        chat(client, max_tokens=6, temperature=1.0, seed=4, logit_bias={str(z): 100}).choices[0].message.content
        == "z" * 6
    )
    with pytest.raises(openai.BadRequestError, match="logit_bias names a token id past the vocabulary|999999"):
        chat(client, max_tokens=2, logit_bias={"999999": 1})


# ---- a client that hangs up -----------------------------------------------------------------


def test_a_client_that_hangs_up_mid_stream_has_its_request_aborted_in_the_engine(client, plain):
    plain.only_vime("read from the engine's /metrics")
    before = metrics(plain.url)
    with chat(client, stream=True, **LONG) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break  # leaving the block closes the connection
    deadline = time.monotonic() + 10
    while (m := metrics(plain.url))["requests_aborted_total"] == before["requests_aborted_total"]:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.02)
    assert m["generated_tokens_total"] - before["generated_tokens_total"] < 480
    assert m["num_running"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
    # an answer not streamed, whose client gives up waiting (the engine paused meanwhile, so the
    # request is surely in flight when the client leaves)
    post(plain.url + "/pause_generation", {"mode": "in_place"})
    try:
        with pytest.raises(openai.APITimeoutError):
            chat(client, timeout=0.5, **LONG)
        deadline = time.monotonic() + 10
        while metrics(plain.url)["requests_aborted_total"] == m["requests_aborted_total"]:
            assert time.monotonic() < deadline, "the engine kept a request whose client left"
            time.sleep(0.02)
    finally:
        post(plain.url + "/continue_generation", {})
    after = metrics(plain.url)
    assert after["num_waiting"] == after["num_running"] == 0
    assert after["generated_tokens_total"] == m["generated_tokens_total"]  # it never ran


# ---- refused by name ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"response_format": {"type": "json_object"}}, "response_format 'json_object' is not supported"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"extra_body": {"guided_json": {}}}, r"unsupported field\(s\) \['guided_json'\]"),
        ({"tool_choice": "required", "tools": []}, "tool_choice other than 'auto' or 'none' needs tools"),
        ({"max_tokens": 600}, "max_tokens 600 and the prompt's 21 tokens are more than the model's context of 512"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"reasoning_effort": "low"}, "field 'reasoning_effort' is not supported"),
        ({"extra_body": {"min_tokens": 3}}, "min_tokens 3 is not supported: the vime engine takes it at 0 only"),
    ],
)
def test_what_the_engine_would_not_honour_is_a_400_that_names_it(client, plain, kw, named):
    plain.only_vime("vLLM takes several of these (it has constrained decoding, penalties)")
    with pytest.raises(openai.BadRequestError, match=named) as e:
        chat(client, **kw)
    assert e.value.body["type"] == "invalid_request_error" and e.value.status_code == 400


def test_accepted_and_ignored_fields_change_nothing(client):
    plain_answer = chat(client, max_tokens=8, seed=9).choices[0].message.content
    vllm_preset = {"min_tokens": 0, "min_p": 0, "use_beam_search": False, "spaces_between_special_tokens": True}
    neutral = {"frequency_penalty": 0, "extra_body": {**vllm_preset, "echo": False}}  # what vLLM-minded clients send
    ignored = chat(client, max_tokens=8, seed=9, user="u1", metadata={"k": "v"}, store=False, **neutral)
    assert ignored.choices[0].message.content == plain_answer


# ---- tool calls -----------------------------------------------------------------------------


def tool_chat(client: openai.OpenAI, messages: list, **kw):
    from tool_model import ADD_TOOL

    kw = {"tools": [ADD_TOOL], "temperature": 0, "max_tokens": 80, **kw}
    return client.chat.completions.create(model=TOOL_NAME, messages=messages, **kw)


def test_a_tool_call_comes_back_as_tool_calls_and_its_answer_goes_in_as_a_tool_message(tool_client):
    messages = [{"role": "user", "content": "3+4="}]
    first = tool_chat(tool_client, messages).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
    messages += [first.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    second = tool_chat(tool_client, messages).choices[0]
    assert second.message.content == "Answer: 7" and second.finish_reason == "stop"
    assert not second.message.tool_calls


def test_a_streamed_tool_call_shows_no_call_text_as_content(tool_client):
    content, calls, finish = "", {}, None
    for chunk in tool_chat(tool_client, [{"role": "user", "content": "5+2="}], stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:  # a call may come in pieces (vLLM's do), joined by index
            name, arguments = calls.get(piece.index, ("", ""))
            calls[piece.index] = (name + (piece.function.name or ""), arguments + (piece.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert list(calls) == [0] and calls[0][0] == "add" and json.loads(calls[0][1]) == {"a": 5, "b": 2}


@pytest.mark.parametrize(
    "kw",
    [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "add"}}},
        {"tool_choice": "required", "stream": True},
        {"parallel_tool_calls": False},  # LangChain's with_structured_output(method="function_calling") sends it
    ],
)
def test_tool_choice_required_or_named_answers_a_call(tool_client, tooled, kw):
    """LangChain's bind_tools(tool_choice="any" / a name) and with_structured_output send these;
    the engine opens the call in the prompt (no constrained decoding), the model writes the rest.
    (vLLM constrains the call to its own JSON form, which the tiny model never saw: its
    arguments and finish reason are checked on vime alone.)"""
    from tool_model import ADD_TOOL

    other = {"type": "function", "function": {"name": "sub", "parameters": {"type": "object"}}}
    out = tool_chat(tool_client, [{"role": "user", "content": "6+1="}], tools=[ADD_TOOL, other], **kw)
    if kw.get("stream"):
        pieces = [c.choices[0] for c in out if c.choices]
        assert "".join(p.delta.content or "" for p in pieces) == ""
        calls: dict[int, list[str]] = {}  # a call may come in pieces (vLLM's do), joined by index
        for piece in (tc for p in pieces for tc in p.delta.tool_calls or []):
            name, arguments = calls.setdefault(piece.index, ["", ""])
            calls[piece.index] = [name + (piece.function.name or ""), arguments + (piece.function.arguments or "")]
        ((name, arguments),) = calls.values()
        finish = pieces[-1].finish_reason
    else:
        assert not out.choices[0].message.content
        ((name, arguments),) = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
        finish = out.choices[0].finish_reason
    assert name == "add"
    if tooled.backend == "vime":
        assert json.loads(arguments) == {"a": 6, "b": 1} and finish == "tool_calls"


def test_a_forced_call_names_a_tool_given(tool_client, tooled):
    tooled.only_vime("the messages are vime's")
    with pytest.raises(openai.BadRequestError, match="names the function 'mul', which is not in tools"):
        tool_chat(
            tool_client,
            [{"role": "user", "content": "1+1="}],
            tool_choice={"type": "function", "function": {"name": "mul"}},
        )


def test_tools_reach_the_model_only_when_offered(tool_client):
    for kw in ({"tools": None}, {"tool_choice": "none"}):  # not shown to the model: it answers in words
        out = tool_chat(tool_client, [{"role": "user", "content": "3+4="}], **kw).choices[0]
        assert out.message.content == "I have no tools." and out.finish_reason == "stop" and not out.message.tool_calls


def test_a_template_that_never_shows_tools_is_refused_them(client, plain):
    plain.only_vime("vLLM lets a template drop the tools in silence")
    with pytest.raises(openai.BadRequestError, match="this model's chat template does not show tools to the model"):
        chat(client, tools=[{"type": "function", "function": {"name": "add"}}])


def test_the_server_and_the_multi_turn_rollout_read_a_call_alike():
    """One parser (vime.tool_calls), two readers: what the rollout runs is what a client is told."""
    from vime.engine.openai_api.choices import ChoiceText
    from vime.engine.openai_api.request import read_plan
    from vime.rollout.tools.multi_turn import parse_call
    from vime.tool_calls import HERMES

    text = 'Let me add. <tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    plan = read_plan({"tools": [{"type": "function", "function": {"name": "add"}}]}, chat=True)
    done = ChoiceText(lambda ids: text, plan, HERMES).finish([0], "stop")
    name, arguments = parse_call(text)
    assert (
        (done.tool_calls[0]["function"]["name"], json.loads(done.tool_calls[0]["function"]["arguments"]))
        == (
            name,
            arguments,
        )
        == ("add", {"a": 1, "b": 2})
    )
    assert done.text == "Let me add. " and done.finish_reason == "tool_calls"


def test_errors_of_the_v1_routes_have_openais_shape(tooled):
    tooled.only_vime("the messages are vime's")
    bad = openai.OpenAI(base_url=tooled.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key") as e:
        bad.models.list()
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="this engine serves GET /v1/models") as e:
        openai.OpenAI(base_url=tooled.url + "/v1", api_key=KEY, max_retries=0).embeddings.create(
            model=TOOL_NAME, input="x"
        )

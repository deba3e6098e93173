"""`vime serve` as an OpenAI-compatible server, through the official `openai` client against real
engine processes: the random tiny model (its template shows no tools), and a tiny model trained
to call an `add` tool through a Qwen-like chat template (tests/tool_model.py).

Tolerance: log-probs must match a teacher-forced HF forward within ATOL = 1e-4 (float32 on CPU,
as tests/test_engine.py); the engine answers them from its own scoring of prompt and answer.
"""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest
import torch

from vime.backends.builtin.launch import launch_engine

ATOL = 1e-4
NAME = "tiny-served"  # --served-model-name
TOOL_NAME = "tiny-adder"
KEY = "test-key"
LONG = {"max_tokens": 480, "extra_body": {"ignore_eos": True}}  # a request that runs for a while


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_model, tmp_path_factory):
    args = ["--num-threads", "1", "--served-model-name", NAME, "--seed", "0"]
    proc = launch_engine(str(tiny_model), extra_args=args, log_path=tmp_path_factory.mktemp("logs") / "plain.log")
    yield proc
    proc.shutdown()


@pytest.fixture(scope="module")
def tooled(tmp_path_factory):
    from tool_model import chat_tool_model

    log = tmp_path_factory.mktemp("logs") / "tooled.log"
    args = ["--num-threads", "1", "--served-model-name", TOOL_NAME]
    proc = launch_engine(str(chat_tool_model()), extra_args=args, log_path=log, api_key=KEY)
    yield proc
    proc.shutdown()


@pytest.fixture(scope="module")
def client(plain) -> openai.OpenAI:
    return openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tool_client(tooled) -> openai.OpenAI:
    return openai.OpenAI(base_url=tooled.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_model):
    from vime.models import load_tokenizer

    return load_tokenizer(tiny_model)


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
def hf_logprobs(hf, ids: list[int], start: int) -> list[float]:
    """Raw (temperature-free) log-prob of ids[p] given ids[:p], p from start."""
    logits = hf(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    return [float(lps[p - 1, ids[p]]) for p in range(start, len(ids))]


# ---- the surface a client meets first -------------------------------------------------------


def test_models_lists_the_served_model_and_its_context(client, tiny_model):
    (card,) = client.models.list().data
    assert card.id == NAME and card.owned_by == "vime" and card.max_model_len == 512
    assert client.models.retrieve(NAME).id == NAME
    assert client.models.retrieve(str(tiny_model)).id == str(tiny_model)  # the path given is a name too
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' is not served here: this engine serves"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


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


def test_a_seed_reproduces_at_temperature_one_and_another_seed_differs(client):
    answers = {chat(client, max_tokens=20, temperature=1.0, seed=7).choices[0].message.content for _ in range(3)}
    assert len(answers) == 1
    assert chat(client, max_tokens=20, temperature=1.0, seed=8).choices[0].message.content not in answers


def test_list_prompts_each_get_n_choices_as_if_asked_alone(client, tok):
    prompts = ["1+2=", "hello", tok.encode("abc", add_special_tokens=False)]
    out = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, n=2, seed=3)
    assert [c.index for c in out.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, n=2, seed=3)
        assert [c.text for c in out.choices[2 * p : 2 * p + 2]] == [c.text for c in alone.choices]
    assert out.usage.prompt_tokens == 4 + 5 + 3 and out.usage.completion_tokens == 6 * 8


# ---- log-probs ------------------------------------------------------------------------------


def test_chat_logprobs_are_the_models_raw_log_probs_with_the_likeliest_tokens(client, hf, tok):
    out = chat(client, max_tokens=12, temperature=0.7, seed=2, logprobs=True, top_logprobs=3).choices[0]
    entries = out.logprobs.content
    assert "".join(e.token for e in entries) == out.message.content and len(entries) == 12
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    output = tok.encode(out.message.content, add_special_tokens=False)
    expected = hf_logprobs(hf, ids + output, len(ids))
    assert [e.logprob for e in entries] == pytest.approx(expected, abs=ATOL)
    for e in entries:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and top[0] >= e.logprob - ATOL
    greedy = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1).choices[0]
    assert all(e.top_logprobs[0].token == e.token for e in greedy.logprobs.content)


def test_echo_with_logprobs_scores_the_prompt_too(client, hf, tok):
    out = client.completions.create(model=NAME, prompt="3+4=", max_tokens=5, echo=True, logprobs=2, seed=1).choices[0]
    lp = out.logprobs
    assert out.text.startswith("3+4=") and "".join(lp.tokens) == out.text and len(lp.tokens) == 4 + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = tok.encode(out.text, add_special_tokens=False)
    assert lp.token_logprobs[1:] == pytest.approx(hf_logprobs(hf, ids, 1), abs=ATOL)
    assert lp.text_offset == list(range(9)) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    # echo alone, nothing generated: what lm-eval-harness asks to score a text
    scored = client.completions.create(model=NAME, prompt="3+4=7", max_tokens=0, echo=True, logprobs=0).choices[0]
    assert scored.text == "3+4=7" and scored.logprobs.token_logprobs[1:] == pytest.approx(
        hf_logprobs(hf, tok.encode("3+4=7", add_special_tokens=False), 1), abs=ATOL
    )


# ---- stops and logit_bias -------------------------------------------------------------------


def test_stop_strings_and_stop_ids_end_the_text_before_them(client, tok):
    def complete(stream: bool = False, **kw):
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        out = client.completions.create(
            model=NAME, prompt="a", max_tokens=30, temperature=0, stream=stream, extra_body=extra, **kw
        )
        return "".join(c.choices[0].text for c in out) if stream else out

    text = complete().choices[0].text
    at = next(i for i in range(8, 30) if text.find(text[i : i + 2]) == i)  # a 2-character stop first seen at i
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
    with pytest.raises(openai.BadRequestError, match="logit_bias names a token id past the vocabulary"):
        chat(client, max_tokens=2, logit_bias={"999999": 1})


# ---- a client that hangs up -----------------------------------------------------------------


def test_a_client_that_hangs_up_mid_stream_has_its_request_aborted_in_the_engine(client, plain):
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
        ({"presence_penalty": 0.5}, "presence_penalty 0.5 is not supported"),
        ({"extra_body": {"guided_json": {}}}, r"unsupported field\(s\) \['guided_json'\]"),
        ({"tool_choice": "required", "tools": []}, "tool_choice required is not supported"),
        ({"stream": True, "logprobs": True}, "logprobs with stream: true are not supported"),
        ({"max_tokens": 600}, "max_tokens 600 and the prompt's 21 tokens are more than the model's context of 512"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"reasoning_effort": "low"}, "field 'reasoning_effort' is not supported"),
    ],
)
def test_what_the_engine_would_not_honour_is_a_400_that_names_it(client, kw, named):
    with pytest.raises(openai.BadRequestError, match=named) as e:
        chat(client, **kw)
    assert e.value.body["type"] == "invalid_request_error" and e.value.status_code == 400


def test_accepted_and_ignored_fields_change_nothing(client):
    plain_answer = chat(client, max_tokens=8, seed=9).choices[0].message.content
    ignored = chat(client, max_tokens=8, seed=9, user="u1", metadata={"k": "v"}, store=False, frequency_penalty=0)
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
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
    messages += [first.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    second = tool_chat(tool_client, messages).choices[0]
    assert second.message.content == "Answer: 7" and second.finish_reason == "stop"
    assert not second.message.tool_calls


def test_a_streamed_tool_call_shows_no_call_text_as_content(tool_client):
    content, calls, finish = "", [], None
    for chunk in tool_chat(tool_client, [{"role": "user", "content": "5+2="}], stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.function.name == "add" and json.loads(call.function.arguments) == {"a": 5, "b": 2}


def test_tools_reach_the_model_through_its_template_only_when_offered(tool_client, client):
    for kw in ({"tools": None}, {"tool_choice": "none"}):  # not shown to the model: it answers in words
        out = tool_chat(tool_client, [{"role": "user", "content": "3+4="}], **kw).choices[0]
        assert out.message.content == "I have no tools." and out.finish_reason == "stop" and not out.message.tool_calls
    with pytest.raises(openai.BadRequestError, match="this model's chat template does not show tools to the model"):
        chat(client, tools=[{"type": "function", "function": {"name": "add"}}])


def test_the_server_and_the_multi_turn_rollout_read_a_call_alike():
    """One parser (vime.tool_calls), two readers: what the rollout runs is what a client is told."""
    from vime.engine.openai_api.choices import ChoiceText
    from vime.engine.openai_api.request import read_plan
    from vime.rollout.multi_turn import parse_call
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
    bad = openai.OpenAI(base_url=tooled.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key") as e:
        bad.models.list()
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="this engine serves GET /v1/models") as e:
        openai.OpenAI(base_url=tooled.url + "/v1", api_key=KEY, max_retries=0).embeddings.create(
            model=TOOL_NAME, input="x"
        )

"""`vime serve` as clients other than the official `openai` one call it: raw HTTP as curl and
browsers send it, the requests LangChain and litellm send (reproduced here as raw HTTP; the
libraries themselves are not dependencies), and OpenAI's Responses API (the OpenAI Agents SDK's
default, LangChain's use_responses_api) through the official client. One engine process on the
engine tests' tiny Qwen3, with an API key (a browser's preflight carries none); the Responses
tool-call test starts the tiny tool-calling model of test_openai_server.py.

What it covers, each a call that failed before: a path with a trailing slash (a base URL ending
in one), a browser's CORS preflight (vLLM allows any origin by default), vLLM's /tokenize,
/detokenize and /version, and /v1/responses (a 404 before).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from vime.backends.builtin.launch import launch_engine

NAME = "tiny-clients"
KEY = "clients-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "clients.log"
    args = ["--num-threads", "1", "--served-model-name", NAME, "--seed", "0"]
    proc = launch_engine(str(model_dir), extra_args=args, log_path=log, api_key=KEY)
    yield proc.url
    proc.shutdown()


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
        yield c


def test_a_path_with_a_trailing_slash_is_the_same_route(http):
    """A base URL written with a trailing slash; vLLM's server redirects these, which a POST
    client need not follow: answered in place here."""
    body = {"model": NAME, "messages": HI, "max_tokens": 3, "seed": 1}
    a = http.post("/v1/chat/completions/", json=body)
    b = http.post("/v1/chat/completions", json=body)
    assert a.status_code == 200 and a.json()["choices"] == b.json()["choices"]
    assert http.get("/v1/models/").json()["data"][0]["id"] == NAME
    assert http.post("/v1/completions/", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_a_browsers_preflight_is_answered_for_the_openai_routes_only(http, url):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    headers = {**preflight, "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(url + "/v1/chat/completions", headers=headers)  # no key: a browser sends none here
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    body = {"messages": HI, "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"Origin": "http://localhost:3000"}) as s:
        assert s.status_code == 200 and s.headers["access-control-allow-origin"] == "*"
        assert list(s.iter_lines())[-2] == "data: [DONE]"
    # the engine's own routes are not a web page's to call, nor is the key check skipped
    assert httpx.options(url + "/update_weights_from_disk", headers=preflight).status_code == 403
    assert httpx.post(url + "/v1/models", headers={"Origin": "http://x"}).status_code == 401


def test_vllms_tokenize_detokenize_and_version(http):
    """/tokenize counts a chat as the chat route's usage does (what clients size prompts with)."""
    chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1}).json()
    counted = http.post("/tokenize", json={"model": NAME, "messages": HI}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"] == len(counted["tokens"])
    assert counted["max_model_len"] == 512 and counted["token_strs"] is None
    text = http.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}).json()
    assert "".join(text["token_strs"]) == "hello" and text["count"] == len(text["tokens"])
    assert http.post("/detokenize", json={"model": NAME, "tokens": text["tokens"]}).json() == {"prompt": "hello"}
    assert isinstance(http.get("/version").json()["version"], str)
    refused = http.post("/tokenize", json={"prompt": "a", "truncate_prompt_tokens": 2})
    assert refused.status_code == 400 and "truncate_prompt_tokens" in refused.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert http.post("/tokenize", json={"model": "gpt-4o", "prompt": "a"}).status_code == 404


def test_the_responses_api_answers_what_the_chat_route_does(url):
    """LangChain's use_responses_api, litellm.responses and the OpenAI Agents SDK's default model
    call it: greedy, its text is the chat route's for the same messages, streamed or not."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    kw = {"model": NAME, "max_output_tokens": 6, "temperature": 0}
    messages = [{"role": "system", "content": "be brief"}, *HI]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    answer = client.responses.create(input="hi", instructions="be brief", **kw)
    assert (
        answer.output_text == chat.choices[0].message.content and answer.usage.input_tokens == chat.usage.prompt_tokens
    )
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], **kw
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert final.output_text == client.responses.create(input="hi", **kw).output_text
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert kinds[-1] == f"response.{final.status}"


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"previous_response_id": "resp_1"}, "stores no responses: send the whole conversation in input"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format 'json_object' is not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools\\[0\\] of type 'web_search' is not supported"),
        ({"reasoning": {"effort": "low"}}, "reasoning .* is not supported"),
    ],
)
def test_what_the_responses_api_cannot_keep_is_a_400_that_names_it(url, kw, named):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match=named):
        client.responses.create(model=NAME, input="hi", **kw)


def test_a_responses_tool_call_and_its_output_make_a_second_turn(tmp_path_factory):
    """The Agents SDK's loop: a function_call item out, it and a function_call_output item back
    in, the answer as text (the tiny model trained to call `add`, tests/plugins/tool_model.py)."""
    from tool_model import ADD_TOOL, chat_tool_model

    from unit.engine.test_openai_server import SHAPE32

    log = tmp_path_factory.mktemp("logs") / "responses-tools.log"
    model = str(chat_tool_model(**SHAPE32))
    proc = launch_engine(model, extra_args=["--num-threads", "1"], log_path=log)
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        tool = {"type": "function", **ADD_TOOL["function"]}  # the Responses API's tools are flat
        kw = {"model": model, "tools": [tool], "temperature": 0, "max_output_tokens": 80}
        first = client.responses.create(input="3+4=", **kw)
        (call,) = first.output
        assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 3, "b": 4}
        turn = [
            {"role": "user", "content": "3+4="},
            call.model_dump(),
            {"type": "function_call_output", "call_id": call.call_id, "output": "7"},
        ]
        assert client.responses.create(input=turn, **kw).output_text == "Answer: 7"
        forced = client.responses.create(input="2+5=", tool_choice={"type": "function", "name": "add"}, **kw)
        assert [(o.type, o.name) for o in forced.output] == [("function_call", "add")]
    finally:
        proc.shutdown()


def test_a_web_page_cannot_drive_the_engines_own_routes(http):
    """A page may POST text/plain anywhere without a preflight, and the engine reads JSON whatever
    the Content-Type says: with an Origin header the engine's own routes refuse (a keyless
    loopback engine was a page's to pause or push weights to); a program's request, no Origin,
    is served."""
    page = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    r = http.post("/pause_generation", content=b'{"mode": "abort"}', headers=page)
    assert r.status_code == 403 and "web pages" in r.json()["error"]
    assert http.post("/continue_generation", json={}).status_code == 200
    assert http.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"Origin": "http://x"}
    ).is_success

"""`vime serve` as clients other than the official `openai` one call it: raw HTTP as curl and
browsers send it, and the requests LangChain and litellm send (reproduced here as raw HTTP; the
libraries themselves are not dependencies). One engine process on the engine tests' tiny Qwen3,
with an API key (a browser's preflight carries none).

What it covers, each a call that failed before: a path with a trailing slash (a base URL ending
in one), a browser's CORS preflight (vLLM allows any origin by default), vLLM's /tokenize,
/detokenize and /version, and the Responses API refused by a 404 that names the chat route.
"""

from __future__ import annotations

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
    assert httpx.options(url + "/update_weights_from_disk", headers=preflight).status_code in (401, 405)
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


def test_the_responses_api_is_a_404_that_names_the_chat_route(url):
    """LangChain's use_responses_api, litellm.responses and the OpenAI Agents SDK call it."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="Responses API is not served .* use POST /v1/chat/completions"):
        client.responses.create(model=NAME, input="hi")

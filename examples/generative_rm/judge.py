"""A generative reward model: a second checkpoint, served by a vime engine, reads the question, the
reference answer and the policy's response, and says whether the response is right.

Use it as slime users use theirs, through `--custom-rm-path` with the judge's address in `--rm-url`:

    vime serve --model-path JUDGE_DIR --port 30010 &      # VIME_API_KEY in its environment, if set
    python train.py ... --custom-rm-path examples.generative_rm.judge:judge \
        --rm-url http://127.0.0.1:30010

The judge answers through the engine's OpenAI chat route, greedily (a reward should not be a coin
toss), and its first word decides: "yes" scores 1, anything else 0. A judge that is down or
refuses raises, and vime's reward runner scores that sample 0 and counts it in
`rollout/reward_errors`, as for any reward that fails: a reward model's outage costs rewards, never
the run.
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

# The question the judge is asked. A rubric of one line: small judges follow short prompts better.
RUBRIC = (
    "You grade answers. Reply with one word: Yes if the response's final answer equals the "
    "reference answer, No otherwise."
)
MAX_VERDICT_TOKENS = 4  # "Yes" or "No" and what a tokenizer may put before it
API_KEY_ENV = "VIME_JUDGE_API_KEY"  # the judge engine's key; the run's own engine key is another secret


def judge_messages(prompt: Any, label: Any, response: str) -> list[dict[str, str]]:
    """The chat the judge reads. A chat-format prompt is flattened to its last user turn: the
    judge needs the question, not the policy's system prompt."""
    if isinstance(prompt, list):
        prompt = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
    question = f"Question: {prompt}\nReference answer: {label}\nResponse: {response}\nIs the response correct?"
    return [{"role": "system", "content": RUBRIC}, {"role": "user", "content": question}]


def verdict(text: str) -> float:
    """1.0 when the judge's reply starts with "yes" (any case, any leading space or punctuation)."""
    words = text.strip().lstrip("*\"'`").split()
    return 1.0 if words and words[0].strip(".,:!*\"'`").lower() == "yes" else 0.0


async def ask_judge(url: str, messages: list[dict[str, str]], api_key: str | None = None) -> str:
    """The judge's greedy reply to `messages`, from a vime engine (or any OpenAI-compatible server)
    at `url`; raises on a refusal or an unreachable judge."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"messages": messages, "max_tokens": MAX_VERDICT_TOKENS, "temperature": 0.0}
    chat = f"{url.rstrip('/')}/v1/chat/completions"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
        session.post(chat, json=body, headers=headers) as r,
    ):
        if r.status != 200:
            raise RuntimeError(f"the judge at {url} answered {r.status}: {(await r.text())[:200]}")
        return (await r.json())["choices"][0]["message"]["content"]


async def judge(args, sample) -> float:
    """`--custom-rm-path` entry: the reward of one sample, as the judge at `--rm-url` sees it."""
    if not args.rm_url:
        raise ValueError("the generative judge needs --rm-url: the judge engine's address, e.g. http://127.0.0.1:30010")
    reply = await ask_judge(
        args.rm_url, judge_messages(sample.prompt, sample.label, sample.response), os.environ.get(API_KEY_ENV)
    )
    return verdict(reply)

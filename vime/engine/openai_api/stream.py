"""`stream: true`: an answer as server-sent events, one chunk per piece of text as the engine
books tokens, in OpenAI's chunk shapes (`chat.completion.chunk`, `text_completion`), then
`stream_options.include_usage`'s usage chunk and `data: [DONE]`. Log-probs are the engine's
scoring of the whole answer (`routes.py`), so a choice's come all in its last text chunk, which
clients join to the earlier ones' (none) as they join the text.

Each prompt's engine request runs as a task whose tokens arrive through the engine thread's tap
(`vime.engine.streams`) and whose final output closes its choices. The response starts only once
the first event is in, so a request the engine refuses (too many samples, a bad token id) is an
ordinary 400, not a stream that breaks. When the client hangs up, the handler is cancelled (or
its next write fails) and every task is cancelled with it, each aborting its engine request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from vime.engine.openai_api.choices import ChoiceText
from vime.engine.openai_api.request import Plan, Prompt

if TYPE_CHECKING:
    from vime.engine.core.requests import RequestOutput, SeqOutput
    from vime.engine.streams import OnTokens

Run = Callable[["OnTokens | None"], Awaitable["RequestOutput"]]
Score = Callable[[int, "SeqOutput"], Awaitable["dict | None"]]  # (prompt index, sample) -> its log-probs


class EventStream:
    """The SSE response: each chunk a `data:` line of JSON, the same head on every chunk."""

    def __init__(self, request: web.Request, plan: Plan, head: dict):
        self.request, self.plan = request, plan
        self.head = {**head, "object": "chat.completion.chunk" if plan.chat else "text_completion"}
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, data: dict) -> None:
        await self.response.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")

    async def choice(self, index: int, text: str | None = None, **delta: Any) -> None:
        """One choice's chunk: `text` for completions, the delta's fields for chat; `finish` ends
        it, `logprobs` are the choice's."""
        finish, logprobs = delta.pop("finish", None), delta.pop("logprobs", None)
        if self.plan.chat:
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        usage = {"usage": None} if self.plan.include_usage else {}
        await self.send({**self.head, "choices": [choice], **usage})

    async def close(self, usage: dict | None) -> web.StreamResponse:
        if usage is not None:
            await self.send({**self.head, "choices": [], "usage": usage})
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


async def stream_answer(
    request: web.Request,
    plan: Plan,
    head: dict,
    prompts: list[Prompt],
    runs: list[Run],
    new_text: Callable[[], ChoiceText],
    score: Score | None = None,
) -> web.StreamResponse:
    """Stream the answer to `prompts`, `runs[i]` generating prompt i's samples; `score`, when
    the request asks for log-probs, gives a finished sample's."""
    events: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()

    async def run(i: int) -> None:
        try:
            out = await runs[i](lambda new: events.put_nowait(("tokens", i, new)))
            events.put_nowait(("done", i, out))
        except Exception as e:  # the engine refused it or failed: the stream says so
            events.put_nowait(("error", i, e))

    tasks = [asyncio.create_task(run(i)) for i in range(len(runs))]
    stream = EventStream(request, plan, head)
    try:
        event = await events.get()
        if event[0] == "error":
            raise event[2]
        await stream.open()
        n = plan.params.n
        texts = [new_text() for _ in range(len(prompts) * n)]
        for index in range(len(texts)):  # each choice opens: its role, or the prompt it echoes
            if plan.chat:
                await stream.choice(index, role="assistant", content="")
            elif plan.echo:
                await stream.choice(index, prompts[index // n].text)
        completion, left = 0, len(runs)
        while True:
            kind, i, data = event
            if kind == "error":
                message = " ".join(str(data).split())
                await stream.send({"error": {"message": message, "type": "server_error", "param": None, "code": 500}})
                break
            for j in range(n):
                text = texts[i * n + j]
                if kind == "tokens":
                    if piece := text.advance(data[j]):
                        await stream.choice(i * n + j, piece)
                    continue
                o = data.outputs[j]
                done = text.finish(o.output_ids, o.finish_reason)
                logprobs = await score(i, o) if score is not None else None
                if (piece := text.rest(done)) or logprobs is not None:
                    await stream.choice(i * n + j, piece, logprobs=logprobs)
                if done.tool_calls:
                    calls = [{"index": k, **c} for k, c in enumerate(done.tool_calls)]
                    await stream.choice(i * n + j, tool_calls=calls)
                await stream.choice(i * n + j, finish=done.finish_reason)
                completion += len(o.output_ids)
            left -= kind == "done"
            if not left:
                break
            event = await events.get()
        prompt = sum(len(p.ids) for p in prompts)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return await stream.close(usage if plan.include_usage else None)
    except ConnectionResetError:  # the client left and a write found out first: nobody to answer
        return stream.response
    finally:  # done, failed, or the client left (cancelled): no request generates for nobody
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

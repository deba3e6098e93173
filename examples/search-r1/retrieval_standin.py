"""A stand-in for Search-R1's retrieval server: `POST /retrieve` over a few passages in memory.

vllm-project/vime's search-r1 example asks a dense retriever (an E5 index over Wikipedia, 60+ GB and a GPU)
at `http://127.0.0.1:8000/retrieve` with `{"queries": [q], "topk": k, "return_scores": false}` and
reads `{"result": [[{"contents": '"Title"\\ntext'}, ...]]}`. This answers the same shape from a
handful of passages ranked by the words they share with the query, so the example's files run
on a laptop and in CI. Passages come from a JSONL file of `{"title", "text"}` rows when given.

    python examples/search-r1/retrieval_standin.py [--port 8000] [--corpus passages.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from aiohttp import web

# a few facts the stand-in's questions ask about (tests/plugins/upstream_tool_plugins.py)
DEFAULT_CORPUS = [
    {"title": "Paris", "text": "Paris is the capital of France."},
    {"title": "Tokyo", "text": "Tokyo is the capital of Japan."},
    {"title": "Nile", "text": "The Nile is the longest river in Africa."},
    {"title": "Everest", "text": "Mount Everest is the highest mountain on Earth."},
    {"title": "Python", "text": "Python is a programming language created by Guido van Rossum."},
]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def rank(corpus: list[dict[str, str]], query: str, k: int) -> list[dict[str, str]]:
    """The `k` passages sharing the most words with `query` (ties in corpus order), each as the
    retriever's `{"contents": '"Title"\\ntext'}`."""
    q = _words(query)
    scored = sorted(corpus, key=lambda p: -len(q & _words(p["title"] + " " + p["text"])))
    return [{"contents": f'"{p["title"]}"\n{p["text"]}'} for p in scored[: max(0, k)]]


def make_app(corpus: list[dict[str, str]]) -> web.Application:
    """The `/retrieve` route over `corpus`; a request that is not the retriever's shape is a 400."""

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            queries, k = body["queries"], int(body.get("topk", 3))
            if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                raise ValueError("queries must be a list of strings")
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        return web.json_response({"result": [rank(corpus, q, k) for q in queries]})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    return app


def load_corpus(path: Path | None) -> list[dict[str, str]]:
    if path is None:
        return DEFAULT_CORPUS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="vllm-project/vime's example asks port 8000")
    parser.add_argument("--corpus", type=Path, help="JSONL of {title, text} passages (default: five facts)")
    args = parser.parse_args()
    web.run_app(make_app(load_corpus(args.corpus)), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()

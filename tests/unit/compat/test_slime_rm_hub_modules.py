"""slime's reward helpers at their modules' paths (`slime.rollout.rm_hub.deepscaler`, `.gpqa`,
`.math_utils`'s two checks) and `slime.rollout.rm_hub.remote_rm`, as a reward plug-in of slime's
calls them (tests/plugins/slime_reward_plugins.py): each grades as vime's rule of that name, and
remote_rm posts slime's body to the reward model and returns its answer."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest
from slime_reward_plugins import reward_func

from vime.rollout.types import Sample


@pytest.fixture
def reward_model():
    """A reward model behind HTTP: 1.0 when the response is the label; the bodies it got."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            answer = json.dumps({"score": float(body["response"].strip() == body["label"])}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/score", bodies
    server.shutdown()


def score(args, response: str, label: str, **metadata: object) -> float:
    sample = Sample(prompt="q", response=response, label=label, metadata=metadata)
    return asyncio.run(reward_func(args, sample))


@pytest.mark.parametrize(
    ("response", "label", "metadata", "reward"),
    [
        ("<think>6 and 9</think> so \\boxed{15}", "15", {"domain": "math"}, 1.0),
        ("\\boxed{15} without closing the reasoning", "15", {"domain": "math"}, 0.0),  # deepscaler's rule
        ("it is \\boxed{\\frac{1}{2}}", "0.5", {"domain": "boxed"}, 1.0),
        ("it is \\boxed{3}", "0.5", {"domain": "boxed"}, 0.0),
        ("The answer is (B).", "B", {"domain": "choice"}, 1.0),
        ("Answer: C", "Paris", {"domain": "choice", "choices": ["Rome", "Berlin", "Paris"]}, 1.0),
        ("Answer: A", "Paris", {"domain": "choice", "choices": ["Rome", "Berlin", "Paris"]}, 0.0),
    ],
)
def test_slimes_rule_helpers_grade_as_vimes_rules(response, label, metadata, reward):
    assert score(SimpleNamespace(), response, label, **metadata) == reward


def test_a_choice_label_that_names_no_option_is_one_error_not_a_silent_zero():
    with pytest.raises(ValueError, match="gpqa label 'Paris' names no option letter"):
        score(SimpleNamespace(), "Answer: C", "Paris", domain="choice")


def test_remote_rm_posts_slimes_body_and_returns_the_answer(reward_model):
    url, bodies = reward_model
    args = SimpleNamespace(rm_url=url, reward_timeout=10.0)
    assert score(args, " 15", "15", domain="judged") == 1.0
    assert score(args, "16", "15", domain="judged") == 0.0
    assert bodies[0] == {"prompt": "q", "response": " 15", "label": "15"}

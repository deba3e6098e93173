"""The trajectory the built-in multi-turn generate builds (vime/rollout/tools/multi_turn.py):
token layout, loss mask, log-probs, versions, the gradient of the loss at tool tokens, turns and
context limits, resuming an aborted turn (in the continuous worker too, and inside a tool call on
the real engine).

The trajectory tests script the engine's output (a random tiny model writes no tool calls): the
client below answers each request with the next scripted turn, as the engine protocol does,
through the same runtime and generate path as a run. The one on the real engine (slow) uses a
tiny model fine-tuned to call the calculator (tests/plugins/tool_model.py); whole runs of it in
every mode are tests/e2e/test_tool_runs.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from unit.rollout.tool_workers import no_tool_workers_left  # noqa: F401 (autouse: no tool worker outlives its test)
from vime.config import Config, ConfigError
from vime.models import make_tiny_tokenizer
from vime.rollout.generate import generate_fn, rollout_metrics, sampling_params
from vime.rollout.tools.multi_turn import CALL_END
from vime.rollout.types import Sample, Status

# ---- the trajectory ------------------------------------------------------------------------


class ScriptedEngine:
    """An engine client that writes a scripted conversation: to a request in turn k (the number
    of tool answers in its input) it answers with what is left of turn k's text (a resumed turn
    has part of it already), as the tiny character-level tokenizer encodes it. The first
    request in turn `abort_at[0]` is aborted after `abort_at[1]` tokens, as a weight update
    aborts requests. Records every request."""

    OPENERS = ("<|im_start|>assistant\n", "</tool_response>\n")  # where a turn starts, with or without a template

    def __init__(self, tokenizer, turns: list[str], version: int = 3, abort_at: tuple[int, int] | None = None):
        self.url = "fake://engine"
        self.tok = tokenizer
        self.turns = list(turns)
        self.version = version
        self.abort_at = abort_at
        self.requests: list[tuple[list[int], dict]] = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None):
        self.requests.append((list(input_ids), dict(sampling_params)))
        seen = self.tok.decode(input_ids)
        k = seen.count("<|im_start|>tool") + seen.count("<tool_response>")
        start = max(seen.rfind(o) + len(o) for o in self.OPENERS if o in seen)
        so_far = seen[start:]
        assert self.turns[k].startswith(so_far), (self.turns[k], so_far)
        ids = list(self.tok.encode(self.turns[k][len(so_far) :], add_special_tokens=False))
        ids = ids[: sampling_params["max_new_tokens"]]
        reason = "stop"
        if len(ids) == sampling_params["max_new_tokens"] and not self.turns[k].endswith(CALL_END):
            reason = "length"
        if self.abort_at is not None and self.abort_at[0] == k:
            ids, reason, self.abort_at = ids[: self.abort_at[1]], "abort", None
        return {
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": reason},
                "output_token_logprobs": [-0.5] * len(ids),
                "output_weight_versions": [self.version + k] * len(ids),
            },
        }

    def abort_request(self, rid=None, abort_all=False):
        return {"success": True}

    async def close(self):
        pass


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
PROMPT = "<|im_start|>user\nwhat is 12*34?<|im_end|>\n<|im_start|>assistant\n"
_MODELS: dict = {}


def _model(context: int):
    """A tiny model directory whose config says `context` positions (only its config is read)."""
    import tempfile

    from vime.models import make_tiny_model

    if context not in _MODELS:
        _MODELS[context] = make_tiny_model(Path(tempfile.mkdtemp()) / "m", max_position_embeddings=context)
    return _MODELS[context]


def conversation(turns, chat=True, max_turns=4, response_len=400, abort_at=None, context=None, tools=("calculator",)):
    from vime.rollout.runtime import RolloutRuntime

    tok = make_tiny_tokenizer()
    args = Config(
        hf_checkpoint="tiny",
        prompt_data="unused.jsonl",
        num_rollout=1,
        tools=list(tools),
        max_turns=max_turns,
        apply_chat_template=chat,
        rollout_max_response_len=response_len,
    ).validate("sync")
    # the model's context bounds a conversation when --rollout-max-context-len is not given
    args.model_dir = str(_model(context or 2048))
    engine = ScriptedEngine(tok, turns, abort_at=abort_at)
    args.runtime = RolloutRuntime((engine,), tok)
    prompt = list(tok.encode(PROMPT))
    sample = Sample(index=0, tokens=prompt)
    fn = generate_fn(args)
    out = asyncio.run(fn(args, sample, sampling_params(args)))
    return tok, engine, prompt, out, args


def test_a_tool_turn_is_the_engines_tokens_then_the_answer_masked_out():
    tok, engine, prompt, s, _ = conversation(["Let me compute. " + CALL, "So it is 408.<|im_end|>"])
    answer = "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    turn1 = list(tok.encode("Let me compute. " + CALL, add_special_tokens=False))
    turn2 = list(tok.encode("So it is 408.<|im_end|>", add_special_tokens=False))
    tool = list(tok.encode(answer, add_special_tokens=False))
    assert s.status == Status.COMPLETED
    assert s.tokens == prompt + turn1 + tool + turn2  # exactly what the engine saw and sent, in order
    assert s.response_length == len(turn1) + len(tool) + len(turn2)
    assert s.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert s.rollout_log_probs == [-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)
    # the answer's tokens carry the version of the token before them: staleness counts generated ones
    assert s.weight_versions == [3] * len(turn1) + [3] * len(tool) + [4] * len(turn2)
    assert engine.requests[1][0] == prompt + turn1 + tool  # the second turn continues from those tokens
    assert all(CALL_END in p["stop"] for _, p in engine.requests)
    assert s.metadata["multi_turn"]["turns"] == 2 and s.metadata["multi_turn"]["tool_calls"] == 1
    assert "408" in s.response and s.metadata["multi_turn"]["tool_errors"] == 0
    m = rollout_metrics([[s]])
    assert m["rollout/tool_calls_mean"] == 1.0 and m["rollout/turns_mean"] == 2.0
    assert m["rollout/tool_call_rate"] == 1.0
    assert m["rollout/masked_token_ratio"] == pytest.approx(len(tool) / s.response_length)


def test_tool_tokens_carry_no_gradient():
    """The step's loss, built from the sample as the trainer builds it, has zero gradient at
    every tool token and a nonzero one at every generated token."""
    from vime.algorithms.objective import LossInputs, Objective
    from vime.trainer.step_loss import StepTokens as _StepTokens

    _, _, _, s, args = conversation(["Let me compute. " + CALL, "So it is 408.<|im_end|>"])
    step = _StepTokens.of([s])
    n = s.response_length
    log_probs = torch.full((n,), -0.7, requires_grad=True)
    inputs = LossInputs(
        mask=step.masks[0],
        advantages=torch.ones(n),
        rollout_lp=step.rollout_lps[0],
        has_rollout=step.has_rollout_lps[0],
        seq_ids=torch.zeros(n, dtype=torch.long),
        old=None,
        ref=None,
    )
    loss, _ = Objective.of(args)(log_probs, torch.zeros(n), inputs, step.num_tokens, float(n))
    loss.backward()
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert (log_probs.grad[~mask] == 0).all() and (~mask).sum() > 0
    assert (log_probs.grad[mask] != 0).all()


def test_built_in_grading_reads_the_last_turn_not_a_tools_answer():
    """A model that asks the calculator and then says nothing numeric must not be credited with
    the number in the tool's answer: built-in rewards and eval grade the last turn."""
    from vime.rollout.rewards import Rewards

    _, _, _, s, args = conversation([CALL, "Done.<|im_end|>"])
    assert "408" in s.response and s.final_response == "Done."
    s.label = "408"
    rewards = Rewards(args)
    try:
        asyncio.run(rewards.score([s]))
    finally:
        rewards.close()
    assert s.reward == 0.0
    _, _, _, right, _ = conversation([CALL, "Answer: 408<|im_end|>"])
    assert right.final_response == "Answer: 408"


def test_a_tool_answer_with_a_lone_surrogate_reaches_the_model_as_text():
    """A lone surrogate in a tool's answer raised in tokenizer.encode and ended the run; the
    tool is given as `--tools module:TOOL`, a Tool object."""
    odd = '<tool_call>{"name": "odd", "arguments": {}}</tool_call>'
    tok, _, _, s, _ = conversation([odd, "Fine.<|im_end|>"], tools=["user_tools:ODD"])
    st = s.metadata["multi_turn"]
    assert s.status == Status.COMPLETED and (st["tool_calls"], st["tool_errors"]) == (1, 0)
    assert "<|im_start|>tool\nlone , NUL , ok<|im_end|>" in tok.decode(
        s.tokens
    )  # U+FFFD and NUL: not in its vocabulary


def test_max_turns_leaves_the_last_call_unanswered():
    _, engine, _, s, _ = conversation([CALL, CALL, CALL], max_turns=2)
    st = s.metadata["multi_turn"]
    assert (st["turns"], st["tool_calls"], st["tool_errors"]) == (2, 1, 0)
    assert len(engine.requests) == 2 and s.status == Status.COMPLETED


def test_a_bad_call_is_answered_with_an_error_and_counted():
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "abs(-3)"}}</tool_call>'
    _, _, _, s, _ = conversation([bad, "<tool_call>oops</tool_call>", "I give up.<|im_end|>"], chat=False)
    st = s.metadata["multi_turn"]
    assert st["tool_calls"] == 2 and st["tool_errors"] == 2
    assert "<tool_response>\nerror: not arithmetic" in s.response and "error: not a tool call" in s.response


def test_an_answer_that_would_pass_the_models_context_ends_the_sample_truncated():
    """Without --rollout-max-context-len the model's own context bounds the conversation: the
    engine would refuse a next turn's prompt longer than that."""
    tok = make_tiny_tokenizer()
    prompt_and_call = len(tok.encode(PROMPT)) + len(tok.encode(CALL, add_special_tokens=False))
    _, engine, _, s, _ = conversation([CALL, "never asked"], context=prompt_and_call + 5)
    assert s.status == Status.TRUNCATED and len(engine.requests) == 1 and sum(s.loss_mask) == s.response_length


def test_an_answer_that_does_not_fit_ends_the_sample_truncated():
    tok = make_tiny_tokenizer()
    n = len(tok.encode(CALL, add_special_tokens=False))
    _, engine, _, s, _ = conversation([CALL, "never asked"], response_len=n + 5)
    assert s.status == Status.TRUNCATED and len(engine.requests) == 1
    assert s.response_length == n and s.loss_mask == [1] * n


@pytest.mark.parametrize("aborted_turn", [0, 1])
def test_an_aborted_turn_resumes_where_it_stopped_with_its_earlier_turns(aborted_turn):
    """As after a weight update in the async modes: a turn is aborted after 4 tokens (the one
    with the tool call, or the one after the tool's answer); generating the sample again
    continues that turn, everything before it kept, and the call is still read whole."""
    from vime.rollout.runtime import RolloutRuntime

    tok, engine, prompt, s, args = conversation(["A " + CALL, "So 408.<|im_end|>"], abort_at=(aborted_turn, 4))
    assert s.status == Status.ABORTED and s.metadata["multi_turn"]["tool_calls"] == aborted_turn
    kept = list(s.tokens)
    args.runtime = RolloutRuntime((engine,), tok)
    s = asyncio.run(generate_fn(args)(args, s, sampling_params(args)))
    assert s.status == Status.COMPLETED and s.tokens[: len(kept)] == kept
    assert "<|im_start|>tool\n408<|im_end|>" in tok.decode(s.tokens) and s.response.endswith("So 408.")
    st = s.metadata["multi_turn"]
    assert (st["turns"], st["tool_calls"], st["tool_errors"]) == (2, 1, 0)
    assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) == len(s.weight_versions)
    assert s.response_length - sum(s.loss_mask) == len(
        tok.encode("<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    )


def test_a_requeued_conversation_starts_again_at_turn_one():
    """A group re-queued (aborted without --partial-rollout, or too stale) is generated again
    from its prompt: its conversation state goes with the old response."""
    from vime.rollout.data.source import _fresh

    _, _, prompt, s, _ = conversation([CALL, "So 408.<|im_end|>"])
    s.metadata["task"] = "kept"
    fresh = _fresh(s)
    assert fresh.tokens == prompt and "multi_turn" not in fresh.metadata and fresh.metadata["task"] == "kept"


def test_the_continuous_worker_resumes_an_aborted_conversation(tmp_path):
    """The continuous worker (decoupled mode, where --partial-rollout applies; fully-async runs
    the same worker), as after a weight update: the turn
    after the tool's answer is aborted; the worker resumes the sample (counted in
    rollout/resumed) and trains a conversation whose earlier turn and answer are kept."""
    import json

    from vime.rollout.data.source import DataSource
    from vime.rollout.fully_async_rollout import generate_rollout_fully_async
    from vime.rollout.rewards import Rewards
    from vime.rollout.runtime import RolloutRuntime

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "what is 12*34?", "label": "408"}) + "\n")
    tok = make_tiny_tokenizer()
    args = Config(
        hf_checkpoint="tiny",
        prompt_data=str(data),
        num_rollout=1,
        rollout_batch_size=1,
        n_samples_per_prompt=1,
        rollout_max_response_len=400,
        update_in_flight="resume",  # --partial-rollout, as Config.validate spells it
        max_staleness=4,
        rollout_concurrency=1,  # one conversation in flight: the one aborted is the one drained
        apply_chat_template=True,
        tools=["calculator"],
        custom_rm_path="varied_reward:constant",
    ).validate("async")
    args.model_dir = str(_model(2048))
    engine = ScriptedEngine(tok, ["A " + CALL, "So 408.<|im_end|>"], abort_at=(1, 4))
    args.runtime = RolloutRuntime((engine,), tok, rewards=Rewards(args))
    ds = DataSource(args, tok)
    try:
        out = generate_rollout_fully_async(args, 0, ds)
    finally:
        args.runtime.close()
    (s,) = [s for g in out.samples for s in g]
    assert s.status == Status.COMPLETED and out.metrics["rollout/resumed"] == 1
    answer = "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(s.response_tokens) == "A " + CALL + answer + "So 408.<|im_end|>"
    # requests 0-2 are this conversation's (turn 1, turn 2 aborted, turn 2 resumed: from the
    # tokens it had); the worker may have started the next one since
    resumed = engine.requests[2][0]
    assert len(resumed) > len(engine.requests[1][0]) and resumed == s.tokens[: len(resumed)]
    st = s.metadata["multi_turn"]
    assert (st["turns"], st["tool_calls"]) == (2, 1) and out.metrics["rollout/tool_calls_mean"] == 1.0
    assert s.response_length - sum(s.loss_mask) == len(tok.encode(answer, add_special_tokens=False))


def test_tools_and_a_custom_generate_are_refused_together_in_one_line():
    args = Config(hf_checkpoint="tiny", prompt_data="d.jsonl", num_rollout=1, tools=["calculator"])
    args.custom_generate_function_path = "my.generate"
    with pytest.raises(ConfigError, match="--tools runs the built-in multi-turn generate"):
        args.validate("sync")


@pytest.mark.slow
def test_a_conversation_aborted_inside_its_tool_call_still_calls_the_tool():
    """The tool-calling model on the real built-in engine, greedy. A weight update that aborts a
    turn within the last tokens of its `</tool_call>`, or just after them, left the resumed
    request an output without the whole stop string: the model wrote past its call, answered
    it itself (a wrong sum, trained on as its own tokens), and the tool never ran; a vLLM run in
    CI lost every conversation of a step so. Each cut now resumes to the real tool call, and an
    abort in the second turn resumes it without cutting back to the first turn's call (the
    search starts where that turn's request began: `Sample.generation_start`)."""
    from tool_model import tool_model

    from vime.backends import BACKENDS
    from vime.backends.builtin.launch import launch_engine
    from vime.models import load_tokenizer
    from vime.rollout.runtime import RolloutRuntime

    model = tool_model()
    engine = launch_engine(str(model), device="cpu", dtype="float32")
    tok = load_tokenizer(model)
    args = Config(
        hf_checkpoint=str(model), prompt_data="unused.jsonl", num_rollout=1, tools=["calculator"],
        rollout_max_response_len=160, rollout_temperature=0.0,
    ).validate("async")  # fmt: skip
    args.model_dir = str(model)
    args.runtime = RolloutRuntime([BACKENDS["vime"].make_client(engine.url)], tok)
    fn, params = generate_fn(args), sampling_params(args)
    prompt = tok.encode("3+4=", add_special_tokens=False)

    def resumed(k: int, turn_start: int, turns: int) -> Sample:
        s = Sample(index=0, tokens=prompt + whole.response_tokens[:k], response_length=k, status=Status.ABORTED)
        s.loss_mask, s.rollout_log_probs, s.weight_versions = whole.loss_mask[:k], [0.0] * k, [0] * k
        s.generation_start = turn_start  # as the call that began the aborted turn recorded it
        state = {"turns": turns, "tool_calls": turns, "tool_errors": 0, "tool_seconds": 0.0, "turn_start": turn_start}
        s.metadata["multi_turn"] = state
        return asyncio.run(fn(args, s, params))

    try:
        whole = asyncio.run(fn(args, Sample(index=0, tokens=list(prompt)), params))
        st = whole.metadata["multi_turn"]
        assert (st["turns"], st["tool_calls"], st["last_turn"]) == (2, 1, "Answer: 7")
        text = tok.decode(whole.response_tokens)
        call = len(tok.encode(text[: text.index(CALL_END) + len(CALL_END)], add_special_tokens=False))
        for inside in (5, 3, 0):  # tokens of `</tool_call>` still to come when the abort came
            s = resumed(call - inside, 0, 0)
            st = s.metadata["multi_turn"]
            assert (st["turns"], st["tool_calls"], st["last_turn"]) == (2, 1, "Answer: 7"), (inside, st)
            assert s.tokens == whole.tokens and s.loss_mask == whole.loss_mask
        # the second turn's call recorded where it began; an abort there is searched from it, not
        # from the first turn's call
        assert whole.generation_start == whole.metadata["multi_turn"]["turn_start"] > call
        s = resumed(whole.response_length - 3, whole.generation_start, 1)  # in "Answer: 7"
        assert s.tokens == whole.tokens and s.metadata["multi_turn"]["last_turn"] == "Answer: 7"
    finally:
        args.runtime.close()
        engine.shutdown()

"""The tool-call parsers (vime/tool_calls.py) and what the OpenAI routes make of a sample's text
(vime/engine/openai_api/choices.py, request.py): pure functions, no engine."""

from __future__ import annotations

import json

import pytest

from vime.engine.http_common import BadRequest
from vime.engine.openai_api.choices import ChoiceText
from vime.engine.openai_api.request import read_plan
from vime.tool_calls import HERMES, TOOL_CALL_FORMATS, Malformed, ToolCall, tool_call_format

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add"}}]


@pytest.mark.parametrize(
    "text, content, blocks",
    [
        ("just words", "just words", []),
        ("Let me add. " + CALL, "Let me add. ", [ToolCall("add", {"a": 1, "b": 2})]),
        (
            CALL + "\n" + CALL.replace("add", "sub"),
            "",
            [ToolCall("add", {"a": 1, "b": 2}), ToolCall("sub", {"a": 1, "b": 2})],
        ),
        # arguments written as a JSON string of the object, and a call the text ends inside
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [ToolCall("f", {"x": 1})]),
        ('<tool_call>{"name": "f", "arguments": {}}', "", [ToolCall("f", {})]),
        ("<tool_call>not json</tool_call>", "", [Malformed("not json")]),
        ('<tool_call>{"arguments": {}}</tool_call>', "", [Malformed('{"arguments": {}}')]),
        ('<tool_call>{"name": 3}</tool_call>', "", [Malformed('{"name": 3}')]),
    ],
)
def test_hermes_splits_content_and_call_blocks(text, content, blocks):
    assert HERMES.split(text) == (content, blocks)


def test_a_parser_is_chosen_by_name_from_the_table():
    assert tool_call_format("hermes") is HERMES is TOOL_CALL_FORMATS["hermes"]
    with pytest.raises(ValueError, match="tool-call parser 'mistral': use one of hermes"):
        tool_call_format("mistral")


def text_of(pieces: list[str], body: dict, reason: str = "stop", stop_ids: frozenset = frozenset()):
    """A ChoiceText over a made-up tokenizer whose token i is pieces[i]: streamed one token at a
    time, then finished. (what was streamed, the final answer)"""
    plan = read_plan({"max_tokens": 10, **body}, chat=True)
    text = ChoiceText(lambda ids: "".join(pieces[i] for i in ids), plan, HERMES if plan.tools else None, stop_ids)
    streamed = [text.advance([i]) for i in range(len(pieces))]
    done = text.finish(list(range(len(pieces))), reason)
    return "".join(streamed) + text.rest(done), streamed, done


def test_a_stream_never_shows_the_start_of_a_call_or_of_a_stop_string():
    joined, streamed, done = text_of(["Su", "re ", "<tool", "_call>", CALL[11:]], {"tools": TOOLS})
    assert streamed[:3] == ["Su", "re ", ""] and joined == done.text == "Sure "
    assert done.finish_reason == "tool_calls" and json.loads(done.tool_calls[0]["function"]["arguments"]) == {
        "a": 1,
        "b": 2,
    }
    joined, streamed, done = text_of(["ab", "cE", "N", "D", "xyz"], {"stop": "END"}, reason="stop")
    assert streamed == ["ab", "c", "", "", ""] and joined == done.text == "abc"
    joined, streamed, _ = text_of(["a", "\ufffd", "b"], {})  # a character whose bytes are still arriving
    assert streamed == ["a", "", "\ufffdb"] and joined == "a\ufffdb"


def test_a_block_that_is_not_a_call_leaves_the_whole_text_as_content():
    joined, _, done = text_of(["hi ", "<tool_call>", "oops", "</tool_call>"], {"tools": TOOLS}, reason="length")
    assert (
        done.tool_calls == []
        and done.finish_reason == "length"
        and joined == done.text == "hi <tool_call>oops</tool_call>"
    )


def test_a_stop_token_is_not_text_unless_asked_for():
    assert text_of(["a", "b", "!"], {}, stop_ids=frozenset({2}))[2].text == "ab"
    assert text_of(["a", "b", "!"], {"include_stop_str_in_output": True}, stop_ids=frozenset({2}))[2].text == "ab!"


@pytest.mark.parametrize(
    "body, chat, named",
    [
        ({"temperature": "hot"}, True, r"field 'temperature' has the wrong type \(str\)"),
        ({"echo": True}, True, "echo True is not supported: the vime engine takes it at False only"),
        ({"logprobs": True}, False, "logprobs of /v1/completions is how many likeliest tokens"),
        ({"logprobs": 21}, False, "logprobs 21: give 0 to 20"),
        ({"best_of": 3}, False, "best_of 3 is not supported"),
        ({"stream_options": {"include_usage": True}}, True, "stream_options needs stream: true"),
        ({"stop": ["ok", ""]}, True, "stop must be a non-empty string or a list of them"),
        ({"functions": []}, True, "field 'functions' is not supported: deprecated by OpenAI: give tools"),
        ({"logit_bias": {"x": 1}}, True, "logit_bias key 'x' is not a token id"),
        ({"logit_bias": {"5": 101}}, True, r"logit_bias '5': 101 must be a number in \[-100, 100\]"),
        ({"tools": [{"type": "function"}]}, True, r"tools\[0\] must be"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "mul"}}, "tools": TOOLS},
            True,
            "'mul', which is not in",
        ),
        (
            {"tool_choice": {"type": "allowed_tools"}, "tools": TOOLS},
            True,
            "tool_choice .* is not supported: give 'auto'",
        ),
        ({"tool_choice": "required"}, True, "tool_choice other than 'auto' or 'none' needs tools"),
        ({"use_beam_search": True}, False, "use_beam_search True is not supported: the vime engine takes it at False"),
        ({"bad_words": ["x"]}, True, r"bad_words \['x'\] is not supported"),
    ],
)
def test_a_bad_field_is_refused_by_name(body, chat, named):
    with pytest.raises((BadRequest, ValueError), match=named):
        read_plan(body, chat=chat)


def test_vllms_extensions_at_their_default_are_taken():
    preset = {"min_tokens": 0, "use_beam_search": False, "length_penalty": 1, "spaces_between_special_tokens": True}
    assert read_plan({**preset, "echo": False, "bad_words": []}, chat=True).params == read_plan({}, chat=True).params
    assert read_plan({**preset, "echo": True}, chat=False).echo


def test_fields_sent_as_null_are_absent_and_platform_fields_are_accepted():
    plan = read_plan({"temperature": None, "stop": None, "user": "u", "store": True, "seed": 5, "n": 2}, chat=True)
    assert plan.params.temperature == 1.0 and plan.stop == () and plan.params.sampling_seed == 5 and plan.params.n == 2


def test_tool_choice_says_which_call_the_model_must_make():
    def force(choice):
        return read_plan({"tools": TOOLS, "tool_choice": choice}, chat=True).tools.force

    assert force(None) is force("auto") is None and force("required") == ""
    assert force({"type": "function", "function": {"name": "add"}}) == "add"
    assert read_plan({"tools": TOOLS, "tool_choice": "none"}, chat=True).tools is None


def test_a_forced_calls_opening_begins_the_answer_and_parallel_false_keeps_the_first_call():
    """The opening (in the prompt) and what the model wrote after it read as one call; a stop
    string is looked for in the model's text only, not in the opening."""
    plan = read_plan({"tools": TOOLS, "tool_choice": "required", "stop": ['"']}, chat=True)
    opening = '<tool_call>{"name": "'
    text = ChoiceText(lambda ids: 'add", "arguments": {}}</tool_call>', plan, HERMES, opening=opening)
    assert text.advance([0]) == "" and text.finish([0], "stop").text == opening + "add"  # cut at the model's '"'
    plan = read_plan({"tools": TOOLS, "tool_choice": "required"}, chat=True)
    done = ChoiceText(lambda ids: 'add", "arguments": {}}</tool_call>', plan, HERMES, opening=opening).finish(
        [0], "stop"
    )
    assert done.text == "" and [c["function"]["name"] for c in done.tool_calls] == ["add"]
    two = read_plan({"tools": TOOLS, "parallel_tool_calls": False}, chat=True)
    done = ChoiceText(lambda ids: CALL + CALL.replace("add", "sub"), two, HERMES).finish([0], "stop")
    assert [c["function"]["name"] for c in done.tool_calls] == ["add"] and done.finish_reason == "tool_calls"

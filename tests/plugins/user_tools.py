"""Tools given by dotted path, as a user gives their own (`--tools module:TOOL`, or a function
that makes one), and what is not one: for the tests of how tools load. Light on imports, since
each tool's worker process imports this module (vime/rollout/tools/workers.py)."""

from __future__ import annotations

from vime.rollout.tools.calls import Tool


def sum_tool() -> Tool:
    return Tool("sum", "adds", {"type": "object"}, lambda a: str(sum(a["xs"])))


PRODUCT = Tool("product", "multiplies", {"type": "object"}, lambda a: str(a["x"] * a["y"]))


NOT_A_TOOL = 42


def broken_tool_factory() -> Tool:
    raise OSError("no such index file: wiki.idx")


ODD = Tool("odd", "answers what a tokenizer may choke on", {"type": "object"}, lambda a: "lone \ud800, NUL \x00, ok")

"""The trainer's parts meet at public members: no code of vime reads what a trainer class keeps
private. The actor's parts used to be a mixin and a Protocol reading its `_bucket`, `_forward`,
`_sync` and `_buffers` (issue 67); a part that needs something of another asks its public
interface, so either can change inside without the other knowing."""

import ast

from conftest import ROOT

VIME = ROOT / "vime"


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private_members() -> set[str]:
    """The private names the classes of vime/trainer define: methods and `self._x` attributes."""
    names = set()
    for path in (VIME / "trainer").glob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and _is_self(node.value):
                    names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_code_reads_a_private_member_of_a_trainer_class():
    private = _private_members()
    assert {"_together", "_step"} <= private  # the walk itself sees the classes
    reads = [
        f"{path.relative_to(VIME)}:{node.lineno} {ast.unparse(node)}"
        for path in sorted(VIME.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in private and not _is_self(node.value)
    ]
    assert not reads, f"private members of the trainer's classes read from outside them: {reads}"

"""The project's size rules, checked on every run of the suite rather than by eye at review: no
file of vime/ over 500 lines, no function over 80 (a longer one is split where its steps part);
tests in their folders (tests/unit/<package>/, tests/e2e/, tests/gpu/, tests/plugins/), no test
file over 600 lines."""

import ast
from pathlib import Path

from conftest import ROOT

VIME = ROOT / "vime"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80
TESTS, MAX_TEST_FILE_LINES = ROOT / "tests", 600


def _sources() -> list[Path]:
    files = sorted(VIME.rglob("*.py"))
    assert len(files) > 50, f"found only {len(files)} files under {VIME}"  # the walk itself must see the package
    return files


def test_no_vime_file_is_over_500_lines():
    long = {str(p.relative_to(VIME)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"over {MAX_FILE_LINES} lines: {long}"


def test_no_vime_function_is_over_80_lines():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # from `def` to its last line, decorators aside
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(VIME)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _imports(tree: ast.AST) -> set[str]:
    """Every module a file imports, at its top or inside a function (`from vime import compat` too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_core_never_imports_the_compatibility_package():
    """All that is shaped by slime and vllm-project/vime lives in vime/compat/, which the core
    reaches only through the dialect the entry points hand it (vime/dialect.py): no module
    outside vime/compat/ but the command line imports it, or vllm-project/vime's and slime's module names
    it answers (vime.rollout.vllm_rollout, vime.utils, slime)."""
    foreign = ("vime.compat", "vime.rollout.vllm_rollout", "vime.utils", "vime.rollout.rm_hub", "slime")
    entry = {VIME / "cli.py"}
    found = {}
    for p in _sources():
        if VIME / "compat" in p.parents or p in entry:
            continue
        bad = sorted(
            m for m in _imports(ast.parse(p.read_text())) if any(m == f or m.startswith(f + ".") for f in foreign)
        )
        if bad:
            found[str(p.relative_to(VIME))] = bad
    assert not found, f"the core imports the compatibility package: {found}"


def test_test_files_live_in_the_layout_and_none_is_over_600_lines():
    """A test of one package goes to tests/unit/<package>/ (vime/'s top-level modules: tests/unit/),
    a whole run to tests/e2e/, a CUDA check to tests/gpu/, a plug-in loaded by dotted path to
    tests/plugins/; tests/ itself holds only conftest.py."""
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert not loose, f"test modules at tests/ top level, to move into unit/<package>/, e2e/, gpu/ or plugins/: {loose}"
    long = {
        str(p.relative_to(TESTS)): n
        for p in sorted(TESTS.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_TEST_FILE_LINES
    }
    assert not long, f"test files over {MAX_TEST_FILE_LINES} lines (split by what they test): {long}"

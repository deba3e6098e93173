"""Tools a model may call during a multi-turn rollout (`--tools`), and how a call is run.

A tool is a name, a description and an OpenAI-style JSON schema of its arguments (what the chat
template shows the model), and a function from those arguments to text. Built in: `calculator`
(arithmetic, evaluated from its syntax tree, never by `eval`) and `python` (a program run in a
fresh interpreter). A user's tool is a dotted path to a `Tool`, or to a function returning one
(`--tools mypkg.tools:search`).

A tool never stops a run: one that raises, hangs past `--tool-timeout`, returns something other
than text, or prints more than `--tool-max-output-chars` ends its turn with an error message in
the conversation (the model sees it, as it would see a traceback) and is counted in the rollout
metrics; whatever it returns becomes text a tokenizer takes (`as_text`). The python tool is
where model output becomes code: it runs behind the boundary of `vime.rollout.tools.sandbox`
(namespaces of its own where the kernel allows them, nobody's uid as root, rlimits everywhere),
the strongest this machine allows, which one start-up line names (`detected_sandbox`).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import json
import logging
import math
import operator
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from vime.errors import ConfigError
from vime.plugins import load_function
from vime.rollout.rewards.runner import in_daemon_thread
from vime.rollout.tools import sandbox
from vime.rollout.tools.workers import ToolDied, ToolError, message_of, workers_of

log = logging.getLogger("vime")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[[dict[str, Any]], Any]  # arguments -> text (str, or bytes read as UTF-8)
    in_process: bool = True  # False: fn starts a process of its own and bounds it (python)
    spec: str | None = None  # the --tools path it was loaded by: a user's tool, run in worker processes

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style schema a chat template renders (`tools=[...]`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolResult:
    text: str  # what goes back into the conversation
    error: bool  # the call failed (bad call, raised, timed out, non-text, too long): counted
    seconds: float


# ---------------------------------------------------------------- calculator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 1000  # a result (or a power's operands) past this is refused: 9**9**9 would take minutes


def _finite(value: int | float) -> int | float:
    """A float past 1.8e308 becomes inf without an OverflowError (1e308 * 10, a literal 1e999),
    and inf - inf nan: not an answer to give the model as if it were one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is too large for a floating-point number" if math.isinf(value) else "not a number")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _finite(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > MAX_DIGITS:
            raise ToolError(f"the result would have more than {MAX_DIGITS} digits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:  # a float past 1.8e308, or an integer too large to become one
            raise ToolError("the result is too large for a floating-point number") from None
        if isinstance(value, complex):  # a negative number to a fractional power
            raise ToolError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
            raise ToolError(f"the result has more than {MAX_DIGITS} digits")
        return _finite(value)
    raise ToolError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")


def calculate(arguments: dict[str, Any]) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ToolError('calculator takes {"expression": "<arithmetic>"}')
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (1234 * 5678) - 9"}},
        "required": ["expression"],
    },
    calculate,
)


# ---------------------------------------------------------------- python

MEMORY_BYTES = 512 << 20
OUTPUT_BYTES = 1 << 20  # what the program may print, and any file it writes (RLIMIT_FSIZE: writes past it fail)
SCRATCH_BYTES = 64 << 20  # its directory, a tmpfs of its own where the kernel gives namespaces
# RLIMIT_NPROC, counted per call in the call's user namespace; as nobody where nobody may not have one
# (or without namespaces), the calls running at once share it
PROCESSES = 32
PROBE_TIMEOUT = 60.0  # the start-up test of each boundary: a program printing "ok", on a busy machine


# One thread for numerical libraries: OpenBLAS starts one per core, each reserving address
# space, and on a many-core machine `import numpy` alone then failed under the memory limit.
_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    **dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1"),
}


@dataclass(frozen=True)
class Sandbox:
    """What bounds the python tool's programs (vime.rollout.tools.sandbox says how): namespaces of their
    own where the kernel allows them, else Landlock where it has it; nobody's uid when vime is root.
    `detected_sandbox` picks the strongest that works on this machine."""

    namespaces: bool
    uid: int | None = None
    gid: int | None = None
    landlock: bool = False
    missing: str = ""  # why nothing stronger: the error of the stronger one's test

    @property
    def boundary(self) -> bool:
        """Whether anything but a Python audit hook keeps a program from the run's processes and files."""
        return self.namespaces or self.landlock or self.uid is not None

    def describe(self) -> str:
        """The start-up line: what is in force, and what is not."""
        limits = (
            f"limits: CPU seconds = --tool-timeout, {MEMORY_BYTES >> 20} MiB memory, "
            f"{PROCESSES} processes, {OUTPUT_BYTES >> 20} MiB per file"
        )
        if self.namespaces:
            who = "as nobody, " if self.uid is not None else ""
            return (
                f"python tool: programs run {who}in namespaces of their own: no network, no other process "
                f"visible, the system and Python read-only, only their {SCRATCH_BYTES >> 20} MiB scratch "
                f"directory writable; {limits}"
            )
        if self.landlock:
            who = "as nobody, " if self.uid is not None else ""
            abi = sandbox.landlock_abi()
            network = "no TCP, " if abi >= 4 else "the network open (Landlock ABI < 4), "
            signals = "no signal to another process" if abi >= 6 else "signals to this user's processes (ABI < 6)"
            return (
                f"python tool: no namespaces here ({self.missing}): programs run {who}under Landlock (ABI {abi}): "
                "the system and Python read-only, nothing else readable (no other process's /proc), only their "
                f"scratch directory writable, {network}{signals}; {limits}"
            )
        if self.uid is not None:
            return (
                f"python tool: no namespaces here ({self.missing}): programs run as nobody, out of reach of "
                "the run's processes and private files, but they can write world-writable directories (/tmp) "
                f"and reach the network past a Python audit hook, which is not a boundary; {limits}"
            )
        return (
            f"python tool: NO BOUNDARY here ({self.missing}), run anyway (--unsafe-python-tool): model-written "
            "programs run as this user, with its files, its processes (the run's environment, the engines' API "
            f"key) and the network; only a Python audit hook refuses them, and it can be bypassed; {limits}"
        )

    def config(self, scratch: str, timeout: float) -> dict[str, Any]:
        """The launcher's configuration for one program (vime.rollout.tools.sandbox.launch)."""
        return {
            "namespaces": self.namespaces,
            "landlock": self.landlock,
            "uid": self.uid,
            "gid": self.gid,
            "scratch": scratch,
            "scratch_bytes": SCRATCH_BYTES,
            "cpu_seconds": max(1, math.ceil(timeout)),
            "memory_bytes": MEMORY_BYTES,
            "processes": PROCESSES,
            "file_bytes": OUTPUT_BYTES,
            "env": {**_ENV, "HOME": scratch, "TMPDIR": scratch},
        }


@functools.cache
def detected_sandbox() -> Sandbox:
    """The strongest boundary this machine allows, each tried with a program that prints "ok"
    (once per process, when the python tool is loaded: at start-up)."""
    if os.geteuid() == 0:
        try:
            ids = pwd.getpwnam("nobody")[2:4]
        except KeyError:
            ids = (65534, 65534)
        candidates = [Sandbox(True, *ids), Sandbox(False, *ids, landlock=True), Sandbox(False, *ids)]
    else:
        candidates = [Sandbox(True), Sandbox(False, landlock=True)]
    problems = []
    for box in candidates:
        try:
            out = run_python({"code": "print('ok')"}, PROBE_TIMEOUT, box)
        except ToolError as e:
            out = str(e)
        if out == "ok\n":
            break
        problems.append(out.strip().splitlines()[-1] if out.strip() else "no output")
    else:
        box = Sandbox(False)
    return replace(box, missing="; ".join(problems))


def log_sandbox(tools: dict[str, Tool]) -> None:
    """The start-up line of the python tool's boundary, when it is among `tools`: a warning when
    it is not the kernel's."""
    if PYTHON in tools.values():
        box = detected_sandbox()
        (log.info if box.namespaces or box.landlock else log.warning)(box.describe())


def run_python(arguments: dict[str, Any], timeout: float = 10.0, box: Sandbox | None = None) -> str:
    """What the program prints (its last error line after it when it failed), run in `box`
    (default: `detected_sandbox()`). The wall-clock `timeout` ends it and anything it started.
    A tool of your own that runs model-written Python can call this."""
    code = arguments.get("code")
    if not isinstance(code, str):
        raise ToolError('python takes {"code": "<program>"}')
    box = box or detected_sandbox()
    with tempfile.TemporaryDirectory(prefix="vime-tool-") as scratch, tempfile.TemporaryDirectory() as outputs:
        scratch = os.path.realpath(scratch)
        program, out_path, err_path = (os.path.join(outputs, name) for name in ("program.py", "stdout", "stderr"))
        with open(program, "wb") as f:
            f.write(code.encode("utf-8", "backslashreplace"))  # a lone surrogate (JSON's "\\ud800") as its escape
        with open(program, "rb") as stdin, open(out_path, "wb") as out, open(err_path, "wb") as err:
            config = json.dumps(box.config(scratch, timeout))
            proc = subprocess.Popen(
                [sys.executable, "-I", sandbox.__file__, "launch", config],
                cwd=outputs,
                env=_ENV,
                stdin=stdin,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own group, ended with it: nothing it started outlives the call
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                if box.namespaces:  # the launcher ends the namespace and returns once it is empty
                    proc.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        too_much = os.path.getsize(out_path) >= OUTPUT_BYTES  # its writes past the limit failed (EFBIG)
        with open(out_path, "rb") as f:
            text = f.read(OUTPUT_BYTES).decode("utf-8", "replace")
        with open(err_path, "rb") as f:
            err_lines = f.read(OUTPUT_BYTES).decode("utf-8", "replace").strip().splitlines()
    # what went wrong first, then what it printed: a long output is cut at its end
    printed = f"\nafter it printed:\n{text}" if text else ""
    if timed_out:
        raise ToolError(f"the program ran longer than {timeout:g}s and was stopped{printed}")
    if too_much:
        raise ToolError(f"the program printed more than {OUTPUT_BYTES} bytes and was stopped; it began:\n{text}")
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        why = " (its CPU time limit)" if name == "SIGXCPU" else ""
        raise ToolError(f"the program was stopped by {name}{why}{printed}")
    if proc.returncode != 0:
        raise ToolError((err_lines[-1] if err_lines else f"exit status {proc.returncode}") + printed)
    return text


PYTHON = Tool(
    "python",
    "Run a Python program and return what it prints.",
    {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a program; print() the result"}},
        "required": ["code"],
    },
    run_python,
    in_process=False,
)

BUILTIN_TOOLS = {t.name: t for t in (CALCULATOR, PYTHON)}


def load_tools(specs: list[str], unsafe: bool = False) -> dict[str, Tool]:
    """--tools: built-in names or dotted paths to a Tool (or a function returning one). The python
    tool's sandbox is found here, at start-up (preflight); where none holds, the python tool is
    refused unless `unsafe` (--unsafe-python-tool)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if spec in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[spec]
        else:
            found = load_function(spec, "--tools", ConfigError, "a Tool, or a function returning one", also=(Tool,))
            try:
                tool = found if isinstance(found, Tool) else found()
            except Exception as e:  # the user's factory: its fault, named, before anything starts
                raise ConfigError(
                    f"--tools {spec}: calling it to get the tool raised {type(e).__name__}: {e}"
                ) from None
            if not isinstance(tool, Tool):
                raise ConfigError(
                    f"--tools {spec}: gave {type(tool).__name__}, not a vime.rollout.tools.calls.Tool; "
                    f"or use a built-in tool: {', '.join(BUILTIN_TOOLS)}"
                )
            tool = replace(tool, spec=spec)
        if tool.name in tools:
            raise ConfigError(f"--tools: two tools are named '{tool.name}': give each tool once")
        tools[tool.name] = tool
    if PYTHON in tools.values():
        refuse_without_boundary(detected_sandbox(), unsafe)
    return tools


def refuse_without_boundary(box: Sandbox, unsafe: bool) -> None:
    """The python tool where nothing but a Python audit hook would hold its programs (not root, no
    user namespaces, no Landlock): refused, unless the user says to run it anyway."""
    if not box.boundary and not unsafe:
        raise ConfigError(
            f"--tools python: no boundary for model-written programs can be set up here ({box.missing}): they would "
            "run as this user, with its files and processes (the engines' API key); run vime as root, allow "
            "unprivileged user namespaces (Ubuntu: sysctl kernel.apparmor_restrict_unprivileged_userns=0) or use a "
            "kernel with Landlock, or pass --unsafe-python-tool to run them anyway"
        )


def as_text(out: str | bytes) -> str:
    """What the model reads, whatever a tool gave: bytes as UTF-8 (an invalid sequence becomes
    U+FFFD), and a str's surrogates joined in pairs, a lone one (from `json.loads('"\\ud800"')`, or
    bytes decoded with surrogateescape) becoming U+FFFD: a tokenizer raises on it, which ended the run."""
    if isinstance(out, bytes):
        return out.decode("utf-8", "replace")
    return out.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


async def _in_worker(tool: Tool, arguments: dict[str, Any], timeout: float) -> str | bytes:
    """A user's tool called in one of its worker processes; ToolError with what the model reads
    when it raised, gave no text or ended its process; TimeoutError past the timeout."""
    try:
        grace = 0.0 if tool.in_process else 5.0  # one that bounds its own time says so first
        answer = await in_daemon_thread(workers_of(tool.spec, load_tools).call, arguments, timeout, grace)
    except ToolDied as e:
        raise ToolError(f"{tool.name} ended: {e}") from None
    if answer[0] == "not text":
        raise ToolError(f"{tool.name} returned {answer[1]}, not text")
    if answer[0] == "raised":
        _, kind, message, own = answer
        raise ToolError(message if own else f"{tool.name} raised {kind}: {message}")
    return answer[1]


async def call_tool(tools: dict[str, Tool], name: Any, arguments: Any, timeout: float, max_chars: int) -> ToolResult:
    """Run one call; every failure becomes an error result whose text the model reads."""
    t0 = time.perf_counter()

    def done(text: str, error: bool) -> ToolResult:
        text = as_text(text)
        if len(text) > max_chars:  # an error's text too: a failed program's output comes with it
            text, error = text[:max_chars] + f"\n[cut: {len(text)} characters, the first {max_chars} shown]", True
        return ToolResult(text, error, time.perf_counter() - t0)

    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None:
        return done(f"error: no tool named {name!r} (tools: {', '.join(tools)})", True)
    if not isinstance(arguments, dict):
        return done(f"error: {tool.name}'s arguments must be a JSON object", True)
    try:
        if tool.spec is not None:  # a user's: in a process of its own, which it may end (tool_workers.py)
            out = await _in_worker(tool, arguments, timeout)
        elif tool.in_process:
            out = await asyncio.wait_for(in_daemon_thread(tool.fn, arguments), timeout)
        else:
            out = await asyncio.to_thread(tool.fn, arguments, timeout)
    except ToolError as e:
        return done(f"error: {message_of(e)}", True)
    except TimeoutError:
        return done(f"error: {tool.name} gave no answer within {timeout:g}s", True)
    except Exception as e:  # a tool's own bug: the model reads what went wrong, the run goes on
        return done(f"error: {tool.name} raised {type(e).__name__}: {message_of(e)}", True)
    if not isinstance(out, str | bytes):
        return done(f"error: {tool.name} returned {type(out).__name__}, not text", True)
    return done(out, False)

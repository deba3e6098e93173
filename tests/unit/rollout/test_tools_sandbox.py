"""The python tool as a boundary: model-written programs that try to get out of it.

An escape is tried as a run would meet it: a helper process, standing in for the run, holds a
secret in its environment (as a run or an engine holds VIME_API_KEY) and runs the program
through the python tool, then the same program plainly (`python -c`, its own child). The plain
run gets out every time (it connects, finds the secret, writes the file, may signal the
helper): the control that shows each attempt is real. The tool's run must get nowhere.

vime as root and vime as another user take different paths (root runs programs as nobody;
another user needs a user namespace of its own). When the tests run as root, the other path
runs as a real other uid (setpriv), in a mount namespace where this Python is reachable by it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import ROOT

from vime.config import ConfigError
from vime.rollout.tools import sandbox
from vime.rollout.tools.calls import (
    BUILTIN_TOOLS,
    PROCESSES,
    Sandbox,
    call_tool,
    detected_sandbox,
    refuse_without_boundary,
    run_python,
)

ESCAPE = r"""
import os
port, secret, target, victim = {port}, {secret!r}, {target!r}, HELPER_PID  # the helper fills its pid in
def connect():  # the socket module's own C half: a Python-level block of `socket` misses it
    import _socket
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    return "connected"
def environ():  # every process's environment: the parent's, the engines'
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{{pid}}/environ", "rb") as f:
                if secret.encode() in f.read():
                    found.append(pid)
        except (OSError, ValueError):
            pass
    if not found:
        raise LookupError("no environment readable here holds it")
    return found
def write():
    with open(target, "w") as f:
        f.write("escaped")
    return target
def signal_run():  # signal 0: the permission check of a kill, without the kill
    os.kill(victim, 0)
    return victim
for name, attempt in (("connect", connect), ("environ", environ), ("write", write), ("signal", signal_run)):
    try:
        print(name, "ESCAPED", attempt())
    except Exception as e:
        print(name, "stopped:", type(e).__name__, e)
"""

ATTEMPTS = ("connect", "environ", "write", "signal")

HELPER = r"""
import json, os, subprocess, sys
from vime.rollout.tools.calls import Sandbox, ToolError, detected_sandbox, run_python
job = json.loads(sys.stdin.read())
code = {k: job[k].replace("HELPER_PID", str(os.getpid())) for k in ("control", "tool")}
plain = subprocess.run([sys.executable, "-I", "-c", code["control"]], capture_output=True, text=True)
box = Sandbox(*job["box"]) if job["box"] else detected_sandbox()
try:
    out = run_python({"code": code["tool"]}, 30, box)
except ToolError as e:
    out = str(e)
ids = run_python({"code": "import os; print(os.getuid(), os.getgid(), os.getgroups())"}, 30, box)
print(json.dumps({"control": plain.stdout + plain.stderr, "tool": out, "sandbox": repr(box), "ids": ids}))
"""


NOBODY = 65534
OTHER_UID = 12345

# Run as root, what starts a command as `uid` (empty: as root) in a mount namespace of its own
# where this Python's directories are reachable by any user: a tmpfs over the directory private to
# root that holds them (/root, say), with binds of what is needed from it.
REACHABLE = r"""
set -e
blocked=$1 uid=$2; shift 2
save=$(mktemp -d)
mount --bind "$blocked" "$save"
mount -t tmpfs -o mode=0755 tmpfs "$blocked"
while [ "$1" != -- ]; do mkdir -p "$blocked/$1"; mount --rbind "$save/$1" "$blocked/$1"; shift; done
shift
if [ -n "$uid" ]; then exec setpriv --reuid="$uid" --regid="$uid" --clear-groups "$@"; fi
exec "$@"
"""


def reachable(uid: int | None) -> list[str]:
    """The command prefix that runs the helper, from root, as `uid` (None: as root) where this
    Python is reachable by any user."""
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("running as root, without util-linux's unshare and setpriv to become another user")
    needed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    needed.add(str(ROOT))  # the repository: vime is installed from it
    blocked, children = None, set()
    for path in sorted(needed):
        parts = Path(path).parts
        for i in range(1, len(parts)):
            ancestor = str(Path(*parts[:i]))
            if not os.stat(ancestor).st_mode & 0o001:  # others may not pass through
                if blocked not in (None, ancestor):
                    pytest.skip(f"{blocked} and {ancestor} are both private to root: only one is handled here")
                blocked = ancestor
                children.add(parts[i])
                break
    if blocked is None:
        return [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    script = ["sh", "-c", REACHABLE, "sh", blocked, "" if uid is None else str(uid), *children, "--"]
    return ["unshare", "--mount", "--propagation", "private", *script]


def as_root() -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("not root: vime as root runs programs as nobody, tested where the tests run as root")
    return []


def as_other_user() -> list[str]:
    """Not root: these tests' own user, or from root a real other uid (a user namespace that maps
    root to another uid would not do: the kernel exempts uid 0 from RLIMIT_NPROC, mapped or not)."""
    return reachable(OTHER_UID) if os.geteuid() == 0 else []


USERS = {"as root": as_root, "as a user": as_other_user}


def listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    return s


def connections(s: socket.socket) -> int:
    n = 0
    while True:
        try:
            s.accept()[0].close()
        except BlockingIOError:
            return n
        n += 1


def escape(prefix: list[str], box: tuple | None = None) -> tuple[dict, dict]:
    """Run ESCAPE plainly and through the python tool (in `box`, a Sandbox's fields, else the one
    detected) in a helper started with `prefix`; check that the plain run got out every way and
    the tool's nowhere. (what the tool's run printed, attempt by attempt; the helper's report)"""
    secret = uuid.uuid4().hex
    control_port, tool_port = listener(), listener()
    # where the tool's own directory is made: a directory the program sees (read-only, with namespaces)
    control_file, tool_file = (
        Path(tempfile.gettempdir()) / f"vime-test-{uuid.uuid4().hex}-{k}" for k in ("control", "tool")
    )
    job = {
        name: ESCAPE.format(port=port.getsockname()[1], secret=secret, target=str(target))
        for name, port, target in (("control", control_port, control_file), ("tool", tool_port, tool_file))
    }
    job["box"] = box
    try:
        helper = subprocess.run(
            [*prefix, sys.executable, "-c", HELPER],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env={**os.environ, "VIME_API_KEY": secret},
            timeout=120,
        )
        wrote = {f: f.exists() and f.read_text() == "escaped" for f in (control_file, tool_file)}
    finally:
        control_file.unlink(missing_ok=True)
        tool_file.unlink(missing_ok=True)
    assert helper.returncode == 0, helper.stderr[-3000:]
    report = json.loads(helper.stdout)
    control = dict(line.split(" ", 1) for line in report["control"].splitlines())
    tool = dict(line.split(" ", 1) for line in report["tool"].splitlines())
    # the control: each attempt is real, and works for a program outside the tool
    assert set(control) == set(ATTEMPTS) and all(v.startswith("ESCAPED") for v in control.values()), report
    assert connections(control_port) == 1 and wrote[control_file]
    # the tool: nothing got out
    assert set(tool) == set(ATTEMPTS) and all(v.startswith("stopped:") for v in tool.values()), report
    assert secret not in report["tool"]
    assert connections(tool_port) == 0 and not wrote[tool_file]
    return tool, report


@pytest.mark.parametrize("user", USERS)
def test_a_model_written_program_cannot_get_out(user):
    """Connect to a port on this machine (through `_socket`), read the secret from any process's
    /proc/<pid>/environ (the parent's first of all), write outside its directory, signal the run."""
    tool, report = escape(USERS[user]())
    if "namespaces=True" in report["sandbox"]:  # the kernel stopped each, not the Python-level hook
        assert not any("not allowed in the python tool" in v for v in tool.values()), report


def test_as_root_without_namespaces_programs_run_as_nobody():
    """Root's fallback where the kernel refuses namespaces (a container without CAP_SYS_ADMIN):
    programs run as nobody, under the Python-level hook."""
    prefix = reachable(None) if os.geteuid() == 0 else pytest.skip("not root")
    _, report = escape(prefix, box=(False, NOBODY, NOBODY))
    assert report["ids"] == f"{NOBODY} {NOBODY} []\n"


@pytest.mark.parametrize("user", USERS)
def test_a_fork_bomb_is_bounded_and_ends_with_the_call(user):
    """Forks until refused, each child a process that would sleep for ten minutes; the call's
    timeout ends them all before it returns."""
    prefix = USERS[user]()
    marker = f"vime-test-bomb-{uuid.uuid4().hex}"
    bomb = f"""
import os, sys, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError as e:
        print(n, "forks, then", type(e).__name__, flush=True)
        break
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
    n += 1
time.sleep(600)
"""
    script = (
        "import json, sys; from vime.rollout.tools.calls import run_python, ToolError\n"
        "try:\n    print(run_python({'code': sys.stdin.read()}, 3))\n"
        "except ToolError as e:\n    print(e)\n"
    )
    r = subprocess.run([*prefix, sys.executable, "-c", script], input=bomb, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ran longer than 3s and was stopped" in r.stdout, r.stdout
    forks = int(r.stdout.split("after it printed:\n")[1].split()[0])
    assert forks < PROCESSES
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            alive += [pid] if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() else []
        except OSError:
            pass
    assert not alive  # nothing it started outlived the call


def test_a_memory_hog_and_an_endless_loop_are_stopped():
    r = asyncio.run(call_tool(BUILTIN_TOOLS, "python", {"code": "x = bytearray(2 << 30)"}, 10, 500))
    assert r.error and "MemoryError" in r.text
    r = asyncio.run(call_tool(BUILTIN_TOOLS, "python", {"code": "while True:\n    pass"}, 1, 500))
    assert r.error and "ran longer than 1s" in r.text


def test_without_namespaces_a_python_hook_refuses_the_same_attempts(tmp_path):
    """The fallback where the kernel allows no namespaces (and vime is not root): no boundary,
    and the start-up line says so; a Python audit hook still refuses the usual ways out."""
    box = Sandbox(False, missing="sandbox: unshare: Operation not permitted")
    assert "NO BOUNDARY here (sandbox: unshare: Operation not permitted)" in box.describe()
    port = listener()
    victim = os.getpid()
    code = ESCAPE.format(port=port.getsockname()[1], secret="no-such-secret", target=str(tmp_path / "escaped"))
    code = code.replace("HELPER_PID", str(victim))
    for name, start in (
        ("popen", "import subprocess; subprocess.run(['true'])"),
        ("fork_exec", "import _posixsubprocess; _posixsubprocess.fork_exec()"),  # no audit event of its own
    ):
        code += f"try:\n    {start}\n    print('{name} ESCAPED')\nexcept PermissionError as e:\n    print('{name} stopped:', e)\n"
    out = dict(line.split(" ", 1) for line in run_python({"code": code}, 10, box).splitlines())
    assert set(out) == {*ATTEMPTS, "popen", "fork_exec"} and all(v.startswith("stopped:") for v in out.values()), out
    assert connections(port) == 0 and not (tmp_path / "escaped").exists()
    # what programs use still works under it
    works = "import asyncio, numpy, sympy; open('f', 'w').write('x'); print(open('f').read())"
    assert run_python({"code": works}, 30, box) == "x\n"


# What stepped around the audit hook's path rules: another process's environment through
# /proc/self/root (the hook matched /proc/<pid> only), a write through a directory's fd (the hook
# took the name as relative to the program's own directory).
AROUND_THE_HOOK = r"""
import os
try:
    with open("/proc/self/root/proc/{victim}/environ", "rb") as f:
        print("environ", "ESCAPED" if {secret!r}.encode() in f.read() else "read, without the secret")
except OSError as e:
    print("environ stopped:", type(e).__name__)
try:
    d = os.open({folder!r}, os.O_RDONLY | os.O_DIRECTORY)
    os.close(os.open("escaped", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=d))
    print("write ESCAPED")
except OSError as e:
    print("write stopped:", type(e).__name__)
"""


def test_without_namespaces_landlock_stops_what_stepped_around_the_hook(tmp_path):
    """The fallback without namespaces was the audit hook alone ("NO BOUNDARY"), and tool code read
    a process's environment (the engines' key) and wrote outside its directory around it. Where the
    kernel has Landlock, the kernel stops both; the hook-only box, run the same way, shows each
    attempt is real."""
    if sandbox.landlock_abi() < 1:
        pytest.skip("this kernel has no Landlock")
    secret = uuid.uuid4().hex
    victim = subprocess.Popen(["sleep", "60"], env={"VIME_API_KEY": secret})
    try:
        results = {}
        for name, box in (("hook", Sandbox(False)), ("landlock", Sandbox(False, landlock=True))):
            folder = tmp_path / name
            folder.mkdir(mode=0o777)
            code = AROUND_THE_HOOK.format(victim=victim.pid, secret=secret, folder=str(folder))
            out = run_python({"code": code}, 30, box)
            results[name] = (dict(line.split(" ", 1) for line in out.splitlines()), (folder / "escaped").exists())
    finally:
        victim.kill()
        victim.wait()
    assert results["hook"] == ({"environ": "ESCAPED", "write": "ESCAPED"}, True), results
    assert results["landlock"] == ({"environ": "stopped: PermissionError", "write": "stopped: PermissionError"}, False)
    works = "import json, math; open('f', 'w').write(json.dumps(math.pi)); print(open('f').read())"
    assert run_python({"code": works}, 30, Sandbox(False, landlock=True)) == "3.141592653589793\n"
    assert "under Landlock" in Sandbox(False, landlock=True).describe()


def test_the_python_tool_refuses_to_start_without_a_boundary_unless_told_it_is_unsafe():
    """Nothing but the hook (not root, no user namespaces, no Landlock): refused at start-up in one
    line, unless --unsafe-python-tool; any boundary passes."""
    with pytest.raises(
        ConfigError, match=r"^--tools python: no boundary .* here \(sandbox: unshare: no\).*--unsafe-python-tool"
    ):
        refuse_without_boundary(Sandbox(False, missing="sandbox: unshare: no"), unsafe=False)
    refuse_without_boundary(Sandbox(False), unsafe=True)
    for box in (Sandbox(True), Sandbox(False, landlock=True), Sandbox(False, NOBODY, NOBODY)):
        refuse_without_boundary(box, unsafe=False)


def test_the_start_up_line_says_what_is_in_force(caplog):
    """Logged where the multi-turn generate loads its tools, once, after the run's log is open."""
    from vime.rollout.tools.multi_turn import _tools

    _tools.cache_clear()
    with caplog.at_level("INFO", logger="vime"):
        _tools(("calculator", "python"), True)
        _tools(("calculator", "python"), True)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("python tool:")]
    box = detected_sandbox()
    assert line == box.describe()
    if box.namespaces:
        assert "no network, no other process visible" in line
    else:
        assert box.missing in line

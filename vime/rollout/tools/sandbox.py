"""Where the python tool runs model-written code: a launcher that puts the program out of the
run's reach, run as a script of its own (standard library only, no vime import).

`python -I sandbox.py launch CONFIG` with the program on stdin. Where the kernel allows it
(`namespaces`) the launcher unshares a mount, PID, network and IPC namespace (and a user
namespace when vime is not root: an unprivileged user may create one, root needs none), then:

* the root is a read-only tmpfs holding the system directories (/usr, /etc, /lib...) and the
  Python installation bind-mounted read-only, /dev/null, zero, random and urandom, and the scratch
  directory: a tmpfs of its own (`scratch_bytes`), the one place the program can write;
* there is no /proc and the program is PID 1 of a namespace of its own: no other process can
  be seen, read (environment, memory, command line) or signalled, and whatever it starts dies
  with it (the launcher is its parent and its death signal);
* the network namespace has no interface up: no network, no host loopback, no abstract Unix
  socket of the host.

Without namespaces, where the kernel has Landlock (`landlock`), the launcher restricts the program
with it instead, which the kernel enforces on every path however it is reached (`dir_fd`,
`/proc/self/root/...`): the system directories and the Python installation readable, /dev/null,
zero, random and urandom, and the scratch directory the one place it can write; nothing else
(no /proc: no other process's environment), and from Landlock ABI 4 no TCP, from ABI 6 no signal
to a process outside it and no abstract Unix socket.

Everywhere: a clean environment (the caller's `env`), `uid` when given (root runs programs as
`nobody`: the run's processes and private files are out of reach even without namespaces), no
new privileges, and rlimits on CPU seconds, address space, processes and file size, no core
files. Without namespaces the runner also installs a Python audit hook (`_guard`) refusing
sockets, ctypes, new processes, signals, other processes' /proc entries and writes outside the
scratch directory: defence in depth only, since native code or an interpreter bug gets past
any hook (and its path rules were stepped around). The caller says which boundary holds at
start-up, and refuses the python tool where none does unless told it is unsafe.

The program itself runs in a fresh `python -I -c <this file> run CONFIG`: the runner reads it
from stdin, points stdin at /dev/null and executes it as `__main__` (file name program.py).
A setup failure is one line on stderr, `sandbox: ...`, and exit status 125.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import signal
import struct
import sys

SETUP_FAILED = 125
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "random", "urandom")

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# Landlock's system calls (one number on every architecture) and rights (linux/landlock.h)
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR, FS_TRUNCATE, FS_IOCTL_DEV = 1, 2, 4, 8, 1 << 14, 1 << 15
FS_FILE_RIGHTS = (
    FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
)  # what a rule on a file may grant
FS_RIGHTS = {
    1: (1 << 13) - 1,
    2: (1 << 14) - 1,
    3: (1 << 15) - 1,
    5: (1 << 16) - 1,
}  # every right, by the ABI adding them
NET_TCP, SCOPE_ALL = 3, 3  # bind and connect (ABI 4); abstract Unix sockets and signals (ABI 6)
# pivot_root has no libc wrapper
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# flags a bind mount keeps from its source: in a user namespace a remount that drops them is refused
KEPT_FLAGS = {
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}


class SetupError(Exception):
    """The sandbox could not be set up: the caller reports it, never runs the program without it."""


@functools.cache
def _libc():
    import ctypes  # the launcher's only: the runner never loads it

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _call(what: str, fn, *args) -> None:
    ctypes, _ = _libc()
    if fn(*args) != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    ctypes, libc = _libc()
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _call(f"mount {target}", libc.mount, enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])


def _mounts_under(path: str) -> list[str]:
    """Mount points at or under `path` in this mount namespace (a recursive bind brings the
    source's submounts along, and each needs its own read-only remount)."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])  # \040: a space
            if point == path or point.startswith(path + "/"):
                points.append(point)
    return points


def _bind_read_only(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    for point in _mounts_under(target):
        kept = sum(ms for st, ms in KEPT_FLAGS.items() if os.statvfs(point).f_flag & st)
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def read_only_paths() -> list[str]:
    """The system directories and this Python's installation (the environment's and the one it
    was made from), outermost first; a symlink among them (/bin -> usr/bin) is kept as one."""
    wanted = [*SYSTEM_DIRS, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    wanted.append(os.path.dirname(os.path.realpath(sys.executable)))
    found = sorted({q for p in wanted if os.path.lexists(p) for q in (os.path.abspath(p), os.path.realpath(p))})
    kept: list[str] = []
    for path in found:  # sorted: a directory comes before what is under it
        if path != "/" and not any(path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _user_namespace() -> None:
    """A user namespace of this process's own, with its ids mapped to themselves: files keep their
    owners, exec drops every capability, and RLIMIT_NPROC counts the processes in it only."""
    _, libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    _call("unshare", libc.unshare, CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _enter_namespaces(config: dict) -> None:
    """Unshare, and make the mount namespace's root the new tree (see the module's docstring).
    After pivot_root nothing of the host's tree is left to see."""
    ctypes, libc = _libc()
    if os.geteuid():  # not root: a user namespace gives the capabilities the rest needs
        _user_namespace()
    _call("unshare", libc.unshare, CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here shows on the host
    scratch = config["scratch"]
    root = scratch  # its host directory is only the new root's mount point: inside, scratch is a tmpfs of its own
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in read_only_paths():
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            _bind_read_only(path, target)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + scratch)
    owner = f",uid={config['uid']},gid={config['gid']}" if config["uid"] is not None else ""
    _mount("tmpfs", root + scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={config['scratch_bytes']}{owner}")
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupError(f"pivot_root: no system call number known for {os.uname().machine}")
    os.chdir(root)
    _call("pivot_root", libc.syscall, ctypes.c_long(number), b".", b".")
    _call("umount the host's root", libc.umount2, b".", MNT_DETACH)
    os.chdir("/")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where it has none (or it is off)."""
    ctypes, libc = _libc()
    version = libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(version, 0)


def _landlock(scratch: str) -> None:
    """Restrict this process and what it executes: see the module's docstring. Needs no new
    privileges set first (`launch` sets it)."""
    ctypes, libc = _libc()
    abi = landlock_abi()
    if abi < 1:
        raise SetupError("landlock: this kernel has none")
    every = FS_RIGHTS[max(v for v in FS_RIGHTS if v <= abi)]
    attr = struct.pack("=QQQ", every, NET_TCP if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    attr = attr[: 8 if abi < 4 else 16 if abi < 6 else 24]  # the struct as this ABI knows it
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise SetupError(f"landlock ruleset: {os.strerror(ctypes.get_errno())}")
    rules = [(p, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR) for p in read_only_paths()]
    rules += [(f"/dev/{d}", FS_READ_FILE | FS_WRITE_FILE) for d in DEVICES] + [(scratch, every)]
    for path, allowed in rules:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        allowed &= every if os.path.isdir(path) else FS_FILE_RIGHTS
        rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
        _call(
            f"landlock rule {path}",
            libc.syscall,
            ctypes.c_long(LANDLOCK_ADD_RULE),
            ruleset,
            LANDLOCK_RULE_PATH_BENEATH,
            rule,
            0,
        )
        os.close(fd)
    _call("landlock_restrict_self", libc.syscall, ctypes.c_long(LANDLOCK_RESTRICT_SELF), ruleset, 0)
    os.close(ruleset)


def _exit_like(status: int) -> None:
    """End the launcher as its child ended: a signal as that signal, so the caller reads both alike."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is to be ignored
    os._exit(code)


def launch(config: dict) -> None:
    with open(__file__) as f:  # the runner's code, read before the host's tree goes away
        source = f.read()
    _, libc = _libc()  # loaded while this Python's files are readable: nobody may not read them
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.umask(0o022)
    if config["namespaces"]:
        _enter_namespaces(config)
        child = os.fork()  # the first process of the new PID namespace
        if child:  # the caller's timeout (SIGTERM) ends the namespace; waitpid returns once it is empty
            signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
            _exit_like(os.waitpid(child, 0)[1])
    elif config["uid"] is not None:
        os.chown(config["scratch"], config["uid"], config["gid"])
    if config["uid"] is not None:  # every capability goes with uid 0
        os.setgroups([])
        os.setresgid(config["gid"], config["gid"], config["gid"])
        os.setresuid(config["uid"], config["uid"], config["uid"])
        if config["namespaces"]:  # a user namespace of nobody's own where allowed: its process limit
            libc.unshare(CLONE_NEWUSER)  # is this call's alone (ids unmapped: /proc is gone, nothing needs them)
    if config["namespaces"]:  # the launcher killed at the timeout takes the namespace with it
        _call("prctl PDEATHSIG", libc.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _call("prctl NO_NEW_PRIVS", libc.prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if config["landlock"]:
        _landlock(config["scratch"])
    # set after the uid changes: a limit already low at setuid would refuse the exec below
    for limit, value in (
        (resource.RLIMIT_CPU, config["cpu_seconds"]),
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_NPROC, config["processes"]),
        (resource.RLIMIT_FSIZE, config["file_bytes"]),
    ):
        resource.setrlimit(limit, (value, value))
    os.chdir(config["scratch"])
    runner = {"guard": not config["namespaces"], "scratch": config["scratch"]}
    os.execve(sys.executable, [sys.executable, "-I", "-c", source, "run", json.dumps(runner)], config["env"])


def _guard(scratch: str) -> None:
    """A Python audit hook for when the kernel gives no namespaces: refuse what would reach past
    the program's directory. Not a boundary (native code, or an interpreter bug, gets past it)."""
    # ctypes may load (sympy imports it), not call: a foreign call reaches past every hook
    refused = ("socket.", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.string_at")
    refused += ("ctypes.wstring_at", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn")
    refused += ("os.fork", "os.kill", "os.pidfd_open", "pty.")
    writes = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.replace", "os.symlink", "os.link"}
    writes |= {"os.chmod", "os.chown", "os.truncate", "os.utime"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    other_process = re.compile(r"/proc/(\d+)(/|$)")
    pid = os.getpid()

    def inside(path: str | bytes | os.PathLike) -> bool:
        full = os.path.normpath(os.path.join(os.getcwd(), os.fsdecode(path)))
        return full == scratch or full.startswith(scratch + "/")

    def hook(event: str, args: tuple) -> None:
        if event.startswith(refused):
            raise PermissionError(f"{event} is not allowed in the python tool")
        if event == "open" and args[0] is not None and not isinstance(args[0], int):
            path = os.path.normpath(os.path.join(os.getcwd(), os.fsdecode(args[0])))
            m = other_process.match(path)
            if m and int(m.group(1)) != pid:
                raise PermissionError(f"{path}: another process's entries are not readable in the python tool")
            if isinstance(args[2], int) and args[2] & write_flags and not inside(path):
                raise PermissionError(f"{path}: the python tool writes only in its own directory")
        elif event in writes and not all(inside(a) for a in args[:2] if isinstance(a, str | bytes | os.PathLike)):
            raise PermissionError(f"{event}: the python tool writes only in its own directory")

    sys.addaudithook(hook)
    import _posixsubprocess  # subprocess's own fork_exec raises no audit event

    def no_process(*args: object) -> None:
        raise PermissionError("starting a process is not allowed in the python tool")

    _posixsubprocess.fork_exec = no_process


def run(config: dict) -> None:
    import builtins
    import types

    if config["guard"]:
        _guard(config["scratch"])
    program = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    main = types.ModuleType("__main__")  # its own, not this runner's globals
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = ["program.py"]
    exec(compile(program, "program.py", "exec"), main.__dict__)


if __name__ == "__main__":
    step, config = sys.argv[1], json.loads(sys.argv[2])
    if step == "run":
        run(config)
    else:
        try:
            launch(config)
        except (SetupError, OSError) as e:
            sys.stderr.write(f"sandbox: {e}\n")
            sys.stderr.flush()
            os._exit(SETUP_FAILED)

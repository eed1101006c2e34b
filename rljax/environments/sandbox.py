"""Run untrusted Python (model-written code) in a sandbox: `run_python(code) -> ExecResult`.

    result = run_python("print(sum(range(10)))", timeout_s=2.0, memory_mb=128)
    result.stdout == "45\\n"; result.killed_reason is None

Model text is adversarial input: an infinite loop, a fork bomb, a memory bomb, gigabytes of output, a
write over the repository, a read of a secret, a network connection, a signal to the trainer,
children that detach (setsid, double fork) to outlive the run. docs/sandbox.md lists the layers, what
each guarantees and how the tests attack them. In short:

1. A fresh scratch directory (a `tempfile.mkdtemp`, deleted after the run) is the working directory
   and the only place the program can write; the program is `main.py` in it, `files` beside it.
2. An empty environment (`env={}`) and `python -E -s -B`: no inherited variables, no user site, no
   `.pyc` written. `stdin` goes through a pipe, so input the program has read cannot be read again
   (the code tasks send their hidden test inputs that way).
3. Resource limits set in the child just before it `exec`s the program: RLIMIT_CPU, RLIMIT_AS
   (`memory_mb`: an allocation past it raises MemoryError), RLIMIT_NPROC, RLIMIT_NOFILE,
   RLIMIT_FSIZE and RLIMIT_CORE = 0.
4. Never the caller's privileges: a root caller's program runs as `nobody` (uid/gid 65534, no
   supplementary groups; the kernel exempts uid 0 from RLIMIT_NPROC, so only that bounds a fork bomb),
   so it cannot write root's files, read files only root may read, or signal the trainer.
5. The namespace sandbox, required by default: `bwrap` (bubblewrap) with new PID, network, IPC, UTS
   (and, where the kernel allows, cgroup) namespaces, `--die-with-parent`, the host's file system
   read-only with empty read-only tmpfs over `HIDDEN_PATHS` (home directories, /root, /tmp, /var/tmp,
   /run, the caller's working directory, `SandboxConfig.hide`), the Python installation mounted back
   read-only and the scratch directory writable at `/tmp/sandbox`. A root caller keeps the host's
   user namespace (a user namespace's uid would map to root outside) and the bootstrap drops to
   `nobody` inside; other callers get `--unshare-all` and `--uid/--gid 65534` in a user namespace
   of their own. At the end of a run bwrap's process group is SIGKILLed, which takes its PID
   namespace, and with it every descendant however it detached, down.

Without a working bwrap a run is refused (`SandboxUnavailable`, naming bubblewrap and
`apt-get install bubblewrap`) unless `allow_unsandboxed: true`, which logs a warning when the
sandbox is built (`check_namespaces`) and on the first run of a process. Then a supervisor (the
child's first code, `_SUPERVISOR`) keeps the caller's privileges, makes itself a child subreaper
(PR_SET_CHILD_SUBREAPER), unshares what the kernel allows (a PID namespace whose init is its child,
a network namespace with a loopback that is down, IPC; a mount namespace with an empty tmpfs over
the directory that kept `nobody` from the interpreter, e.g. /root for a Python in /root/.pyenv) and
runs the program in a session of its own as `nobody`. At the timeout (the caller's SIGTERM), at the
program's exit, or when the caller dies, it SIGKILLs every descendant (each orphan is reparented to
it) until none is left. It refuses (no program run, `SandboxUnavailable`) when the program cannot
drop privileges: a root caller whose interpreter `nobody` cannot reach and no mount namespace to fix
that, or a caller that is not root without a user and a PID namespace (the program would run as the
caller and could signal it). `ExecResult.isolation` names the layers a run got.

What is not bounded: disk use inside the scratch directory beyond `max_file_mb` per file (many files
can be written until the timeout); CPU shares (a run is one process group on a shared CPU). Without
bwrap also: the program sees the host's file system as `nobody` does (world-readable files, and it
may write world-writable directories such as /tmp and /dev/shm until the timeout), and it has the
host's network where the kernel refused a network namespace.

`killed_reason` (None when the program ran to its end without hitting a bound) names what stopped
or refused it: "timeout" (the wall clock; `timed_out` is True), "cpu_time" (RLIMIT_CPU),
"output_limit" (more than `max_output_bytes` on stdout or stderr: the run is killed, what was read
is kept and `output_truncated` is True), "memory" (MemoryError), "processes" (fork refused: EAGAIN),
"open_files" (EMFILE), "file_size" (EFBIG), "denied" (EROFS, EACCES or EPERM: a write outside the
scratch directory, a signal to another process), "network" (no route, refused, no name
resolution), "signal:<NAME>" (killed by another signal), "sandbox_error" (bwrap could not start it).
The refusals ("memory" to "network") are read from the last line of the program's stderr when it
exits with an uncaught exception: the sandbox refused the operation, the program died of it.

Concurrency: every run takes a slot of a process-wide semaphore of `max_concurrent` slots (one per
distinct value); `run_many` runs a list of programs on a thread pool of that size.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, NamedTuple, Sequence

from rljax.errors import UserError

logger = logging.getLogger(__name__)

NOBODY = 65534  # uid and gid a root caller's program runs as
SCRATCH_INSIDE = "/tmp/sandbox"  # where the scratch directory appears inside the namespace sandbox
HIDDEN_PATHS = ("/home", "/root", "/tmp", "/var/tmp", "/run", "/work")
_CHUNK = 65536  # bytes per read of the program's output: the parent never holds more than the cap + this


class SandboxUnavailable(UserError, RuntimeError):
    """bwrap is missing or does not work here and `allow_unsandboxed` is not set, or the program
    cannot be run as an unprivileged user (a setup problem the command line reports as such, without
    a traceback)."""


class ExecResult(NamedTuple):
    """What one `run_python` call returns."""

    stdout: str  # decoded as UTF-8 (bad bytes replaced), at most `max_output_bytes` of it
    stderr: str
    returncode: int | None  # the program's exit status; negative: killed by that signal; None: never started
    timed_out: bool  # stopped at the wall-clock timeout
    killed_reason: str | None  # see the module docstring; None: it ran to its end within every bound
    output_truncated: bool = False  # stdout or stderr went past `max_output_bytes`
    duration_s: float = 0.0  # wall clock of the run (process start to end)
    namespaces: bool = False  # it ran inside bwrap's namespaces
    isolation: tuple[str, ...] = ()  # without bwrap: the layers the supervisor put in place (docs/sandbox.md)


@dataclass(frozen=True)
class SandboxConfig:
    """Bounds of a sandboxed run. From a config mapping: `SandboxConfig.from_options({...})`, e.g.
    `sandbox: {timeout_s: 2, memory_mb: 256}`. Without a working bwrap a run is refused
    (`SandboxUnavailable`) unless `allow_unsandboxed: true`."""

    timeout_s: float = 5.0  # wall clock, from process start
    memory_mb: int = 256  # address space (RLIMIT_AS); a bare interpreter takes ~17 MB
    max_processes: int = 16  # RLIMIT_NPROC (see the module docstring for how the kernel counts)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file the program can write
    max_output_bytes: int = 1 << 20  # per stream (stdout, stderr); past it the run is killed
    max_concurrent: int = 4  # runs at once in this process with this bound
    use_namespaces: bool = True  # use bwrap where it works
    allow_unsandboxed: bool = False  # run without bwrap's namespaces (a warning each run) instead of refusing
    hide: tuple[str, ...] = ()  # more host paths to hide under an empty tmpfs (with bwrap)

    def __post_init__(self):
        for name in ("timeout_s",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"sandbox.{name} must be a positive number of seconds, got {value!r}")
        for name in ("memory_mb", "max_processes", "max_open_files", "max_file_mb", "max_output_bytes",
                     "max_concurrent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox.{name} must be a positive integer, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError(f"sandbox.max_open_files must be at least 16 (the interpreter needs some), "
                             f"got {self.max_open_files}")
        for name in ("use_namespaces", "allow_unsandboxed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sandbox.{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.hide, str) or not all(isinstance(p, str) and os.path.isabs(p) for p in self.hide):
            raise ValueError(f"sandbox.hide must be a list of absolute paths, got {self.hide!r}")
        object.__setattr__(self, "hide", tuple(self.hide))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | SandboxConfig | None, *, key: str = "sandbox") -> SandboxConfig:
        """A `SandboxConfig` from a config mapping; an unknown key raises `ValueError` naming `key.<name>`."""
        if options is None:
            return cls()
        if isinstance(options, SandboxConfig):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"{key} must be a mapping of sandbox settings, got {options!r}")
        known = {f.name for f in fields(cls)}
        if "require_namespaces" in options:
            raise ValueError(f"{key}.require_namespaces is no longer a setting: a run without bwrap's namespaces is "
                             f"refused by default; set {key}.allow_unsandboxed: true to run without them "
                             "(the program still runs as an unprivileged user), or remove the key")
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{key}: unknown setting(s) {', '.join(map(repr, unknown))}; "
                             f"accepted: {', '.join(sorted(known))}")
        values = dict(options)
        if "hide" in values and isinstance(values["hide"], list):
            values["hide"] = tuple(values["hide"])
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(str(exc).replace("sandbox.", f"{key}.", 1)) from None


# ---------------------------------------------------------------------------------------------
# Public entry points


def run_python(code: str, *, stdin: str = "", timeout_s: float | None = None, memory_mb: int | None = None,
               files: Mapping[str, str | bytes] | None = None, config: SandboxConfig | Mapping | None = None
               ) -> ExecResult:
    """Run `code` as `main.py` in a fresh sandbox and return what it printed and how it ended.

    `stdin`: the program's standard input. `files`: `{relative path: text or bytes}` written into the
    scratch directory before the run. `timeout_s` and `memory_mb` override `config`'s. Blocks for a
    slot of the `max_concurrent` bound first. Never raises for anything the program does; raises
    `SandboxUnavailable` when bwrap does not work and `allow_unsandboxed` is not set (or the program
    could not run unprivileged), `ValueError` for a bad file name or setting. Each run without bwrap
    logs a warning.
    """
    cfg = SandboxConfig.from_options(config)
    if timeout_s is not None or memory_mb is not None:
        cfg = replace(cfg, timeout_s=cfg.timeout_s if timeout_s is None else timeout_s,
                      memory_mb=cfg.memory_mb if memory_mb is None else memory_mb)
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    files = dict(files or {})
    for name in files:
        _check_file_name(name)
    namespaces = cfg.use_namespaces and bwrap_available()
    if not namespaces and (_PLAIN_STATE["layers"] is None or not cfg.allow_unsandboxed or _PLAIN_STATE["refused"]):
        check_namespaces(cfg)  # refuses, or (first run of this process) warns and probes the layers
    with _gate(cfg.max_concurrent):
        return _run(code, stdin, files, cfg, namespaces)


def run_many(codes: Sequence[str], *, stdins: Sequence[str] | None = None, config: SandboxConfig | Mapping | None = None,
             **kwargs: Any) -> list[ExecResult]:
    """`run_python` for each program, `config.max_concurrent` at a time, results in order."""
    cfg = SandboxConfig.from_options(config)
    stdins = list(stdins) if stdins is not None else [""] * len(codes)
    if len(stdins) != len(codes):
        raise ValueError(f"got {len(codes)} programs but {len(stdins)} stdins")
    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=min(cfg.max_concurrent, len(codes)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda pair: run_python(pair[0], stdin=pair[1], config=cfg, **kwargs),
                             zip(codes, stdins)))


def check_namespaces(config: SandboxConfig | Mapping | None = None, *, key: str = "sandbox") -> bool:
    """Whether runs with `config` get bwrap's namespaces. Without them it raises `SandboxUnavailable`
    (naming bubblewrap, how to install it and `key.allow_unsandboxed`) unless `allow_unsandboxed` is
    set, and then logs a warning and checks that the unsandboxed layers work here (refusing when the
    program could not be run as an unprivileged user). Call it when building what will run programs,
    so that a run fails at start, not at its first sample."""
    cfg = SandboxConfig.from_options(config, key=key)
    namespaces = cfg.use_namespaces and bwrap_available()
    if namespaces:
        return True
    why = "turned off (use_namespaces: false)" if not cfg.use_namespaces else f"not usable here: {_BWRAP_STATE['why']}"
    if not cfg.allow_unsandboxed:
        raise SandboxUnavailable(
            f"{key}: refusing to run model-written code without a namespace sandbox: bwrap (bubblewrap) is {why}. "
            "Install it (apt-get install bubblewrap; it must be able to create namespaces here), or set "
            f"{key}.allow_unsandboxed: true to run with weaker isolation (see docs/sandbox.md)")
    layers = unsandboxed_layers()  # raises SandboxUnavailable where the program cannot drop privileges
    logger.warning("%s.allow_unsandboxed: model-written code runs WITHOUT bwrap's namespaces (bwrap is %s); layers "
                   "in force: %s; see docs/sandbox.md", key, why, ", ".join(layers))
    return False


def unsandboxed_layers() -> tuple[str, ...]:
    """The isolation layers a run without bwrap gets here (probed once per process), e.g.
    `("uid:65534", "subreaper", "pid", "net", "mount")`; raises `SandboxUnavailable` when the program
    could not run as an unprivileged user that cannot signal the caller."""
    with _BWRAP_LOCK:
        if _PLAIN_STATE["layers"] is None:
            result = _run("print('ok')", "", {}, SandboxConfig(timeout_s=30.0), False)
            if result.stdout != "ok\n":
                why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
                _PLAIN_STATE["refused"] = f"a probe program failed without bwrap: {why}"
            _PLAIN_STATE["layers"] = result.isolation
    if _PLAIN_STATE["refused"]:
        raise SandboxUnavailable(f"refusing to run model-written code: {_PLAIN_STATE['refused']}; install "
                                 "bubblewrap (apt-get install bubblewrap)")
    return _PLAIN_STATE["layers"]


def bwrap_available() -> bool:
    """Whether bwrap is installed and runs a program in its namespaces here (probed once per process)."""
    with _BWRAP_LOCK:
        if _BWRAP_STATE["ok"] is None:
            _BWRAP_STATE["ok"], _BWRAP_STATE["why"] = _probe_bwrap()
        return bool(_BWRAP_STATE["ok"])


# ---------------------------------------------------------------------------------------------
# One run

_GATES: dict[int, threading.BoundedSemaphore] = {}
_GATES_LOCK = threading.Lock()
_BWRAP_STATE: dict[str, Any] = {"ok": None, "why": ""}
_PLAIN_STATE: dict[str, Any] = {"layers": None, "refused": ""}
_BWRAP_LOCK = threading.Lock()


def _gate(bound: int) -> threading.BoundedSemaphore:
    with _GATES_LOCK:
        if bound not in _GATES:
            _GATES[bound] = threading.BoundedSemaphore(bound)
        return _GATES[bound]


def _check_file_name(name: Any) -> None:
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in name.split("/") or "\x00" in name:
        raise ValueError(f"sandbox files: {name!r} is not a relative path inside the scratch directory")
    if name == "main.py":
        raise ValueError("sandbox files: 'main.py' is reserved (the program)")


def _interpreter() -> tuple[str, str]:
    """The real interpreter (not a venv's link into a hidden directory) and its installation prefix."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return executable, os.path.realpath(sys.base_prefix)


def _run(code: str, stdin: str, files: Mapping[str, str | bytes], cfg: SandboxConfig, namespaces: bool) -> ExecResult:
    root = os.geteuid() == 0
    scratch = tempfile.mkdtemp(prefix="rljax-sandbox-")
    try:
        _write(os.path.join(scratch, "main.py"), code)
        for name, content in files.items():
            _write(os.path.join(scratch, name), content)
        executable, prefix = _interpreter()
        if root:  # the program runs as `nobody`: it owns the scratch directory and nothing else
            os.chmod(scratch, 0o755)
            for dirpath, dirnames, filenames in os.walk(scratch):
                for name in (dirpath, *(os.path.join(dirpath, f) for f in dirnames + filenames)):
                    os.lchown(name, NOBODY, NOBODY)
        if namespaces and root:
            nproc = cfg.max_processes * cfg.max_concurrent  # counted over every process of uid nobody
        elif namespaces:
            nproc = cfg.max_processes  # counted in bwrap's own user namespace
        elif root:
            nproc = _task_count(NOBODY) + cfg.max_processes
        else:
            nproc = cfg.max_processes  # counted in the supervisor's own user namespace
        limits = {
            "cpu": int(math.ceil(cfg.timeout_s)) + 1, "as": cfg.memory_mb << 20, "nproc": nproc,
            "nofile": cfg.max_open_files, "fsize": cfg.max_file_mb << 20, "uid": NOBODY if root else None,
        }
        if namespaces:
            program = [executable, "-E", "-s", "-B", "-c", _BOOTSTRAP, json.dumps(limits), executable]
            return _execute(_bwrap_argv(scratch, prefix, cfg, root) + program, scratch, stdin.encode(), cfg, True)
        limits.update(prefix=prefix, backstop_s=cfg.timeout_s + 10.0, caller=os.getpid())
        program = [executable, "-E", "-s", "-B", "-c", _SUPERVISOR, json.dumps(limits), executable]
        return _execute(program, scratch, stdin.encode(), cfg, False, supervised=True)
    finally:
        _remove(scratch)


def _write(path: str, content: str | bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else bytes(content))


def _remove(scratch: str) -> None:
    def unlock(function, path, _exc):  # a directory the program made unreadable (only a non-root caller)
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            function(path)
        except OSError:
            pass

    shutil.rmtree(scratch, onerror=unlock)


# The child's first code: set the limits, drop to `nobody` where asked, exec the program. Runs with
# the interpreter's own (unlimited) start-up, so the program's limits bind the program alone.
_BOOTSTRAP = """
import json, os, resource, sys
limits = json.loads(sys.argv[1])
if limits["uid"] is not None:
    os.setgroups([]); os.setgid(limits["uid"]); os.setuid(limits["uid"])
cpu = limits["cpu"]
for name, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, limits["as"]),
                    (resource.RLIMIT_NPROC, limits["nproc"]), (resource.RLIMIT_NOFILE, limits["nofile"]),
                    (resource.RLIMIT_FSIZE, limits["fsize"]), (resource.RLIMIT_CORE, 0)):
    soft, hard = value if isinstance(value, tuple) else (value, value)
    resource.setrlimit(name, (soft, hard))
os.execv(sys.argv[2], [sys.argv[2], "-E", "-s", "-B", "main.py"])
"""


# Without bwrap: the child's first code is a supervisor that stays with the caller's privileges and
# runs the program as `nobody` (docs/sandbox.md). argv: limits (JSON), the interpreter, the status fd.
# It reports on the status fd one JSON line of the layers in force ({"layers": [...]}, or
# {"refused": why} and no program run) and one of the program's wait status ({"status": n}).
# SIGTERM (the caller's timeout), the caller's death (PR_SET_PDEATHSIG) or the backstop deadline
# make it SIGKILL every descendant; so does the program's own exit.
_SUPERVISOR = r"""
import ctypes, json, os, resource, signal, stat, sys, time
limits, exe, status_fd = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUSER, NEWPID, NEWNET, NEWIPC = 0x20000, 0x10000000, 0x20000000, 0x40000000, 0x8000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
main_pid, main_status, stop = None, None, False

def report(**item):
    try:
        os.write(status_fd, (json.dumps(item) + "\n").encode())
    except OSError:
        pass

def refuse(why):
    report(refused=why)
    os._exit(70)

def on_term(*_):
    global stop
    stop = True

def reap():
    global main_status
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == main_pid and main_status is None:
            main_status = status

def descendants():
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out

def kill_all():
    # Orphans of killed processes are reparented to us (a subreaper): repeat until none is left.
    while True:
        reap()
        pids = descendants()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)

def reachable(path):
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if os.path.dirname(path) == path:
            return True
        path = os.path.dirname(path)

signal.signal(signal.SIGTERM, on_term)
libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the caller died
if os.getppid() != limits["caller"]:  # it died before the line above
    os._exit(71)
layers = []
if libc.prctl(36, 1, 0, 0, 0) == 0:  # PR_SET_CHILD_SUBREAPER
    layers.append("subreaper")
uid = limits["uid"]
if uid is None:  # not root: a user namespace of our own, or the program could signal the caller
    me, group = os.getuid(), os.getgid()
    if libc.unshare(NEWUSER) != 0:
        refuse("not root and no user namespace here, so the program would run as the caller, able to "
               "signal it and read its files")
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (me, me)), ("gid_map", "%d %d 1" % (group, group))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
    layers.append("user")
if libc.unshare(NEWPID) == 0:
    layers.append("pid")
elif uid is None:
    refuse("no PID namespace here, so the program (running as the caller) could signal it")
if libc.unshare(NEWNET) == 0:
    layers.append("net")
if libc.unshare(NEWIPC) == 0:
    layers.append("ipc")
if uid is not None and not (reachable(exe) and reachable(limits["prefix"])):
    # The interpreter lies under a directory `nobody` cannot enter (a Python in /root/.pyenv): in a
    # mount namespace of our own, an empty tmpfs over that directory with the installation bound back.
    prefix = limits["prefix"]
    top = prefix  # the outermost directory on the way that others cannot enter
    path = prefix
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                top = path
        except OSError:
            pass
    if libc.unshare(NEWNS) != 0 or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        refuse("the interpreter %s is not reachable by uid %d and no mount namespace is available to "
               "make it so" % (exe, uid))
    held = os.open(prefix, os.O_PATH)  # opened in the new namespace: its mount can be bound there
    if libc.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755") != 0:
        refuse("could not mount a tmpfs over %s: errno %d" % (top, ctypes.get_errno()))
    os.umask(0o022)
    os.makedirs(prefix, mode=0o755, exist_ok=True)
    if libc.mount(("/proc/self/fd/%d" % held).encode(), prefix.encode(), None, MS_BIND | MS_REC, None) != 0:
        refuse("could not bind %s back: errno %d" % (prefix, ctypes.get_errno()))
    os.close(held)
    if not (reachable(exe) and reachable(prefix)):
        refuse("the interpreter %s is not reachable by uid %d" % (exe, uid))
    layers.append("mount")
if uid is not None:
    layers.insert(0, "uid:%d" % uid)

def run_program():
    os.setsid()  # a session of its own: not ours
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            os._exit(72)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (after the uid change, which clears it)
    cpu = limits["cpu"]
    for name, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, limits["as"]),
                        (resource.RLIMIT_NPROC, limits["nproc"]), (resource.RLIMIT_NOFILE, limits["nofile"]),
                        (resource.RLIMIT_FSIZE, limits["fsize"]), (resource.RLIMIT_CORE, 0)):
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(name, (soft, hard))
    os.execv(exe, [exe, "-E", "-s", "-B", "main.py"])

report(layers=layers)
main_pid = os.fork()
if main_pid == 0:
    try:
        if "pid" in layers:  # we are the namespace's init: run the program as our child, pass on its status
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the supervisor's death ends the namespace
            program = os.fork()
            if program == 0:
                os.close(status_fd)
                run_program()
            os.close(0); os.close(1); os.close(2)
            while True:
                pid, status = os.waitpid(-1, 0)
                if pid == program:
                    report(status=status)
                    os._exit(0)
        os.close(status_fd)
        run_program()
    finally:
        os._exit(73)
os.close(0); os.close(1); os.close(2)
deadline = time.monotonic() + limits["backstop_s"]
while main_status is None and not stop and time.monotonic() < deadline:
    reap()
    time.sleep(0.005)
if main_status is None or stop:
    report(status=signal.SIGKILL)
elif "pid" not in layers:
    report(status=main_status)
kill_all()
os._exit(0)
"""


def _bwrap_argv(scratch: str, prefix: str, cfg: SandboxConfig, root: bool) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap"]
    if root:  # every namespace but a user namespace (whose uid would map to root outside: see above)
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    else:  # unprivileged bwrap needs a user namespace; there RLIMIT_NPROC counts this sandbox alone
        argv += ["--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    argv += ["--die-with-parent", "--new-session"]
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    hidden = _hidden_paths(cfg, prefix)
    for path in hidden:
        argv += ["--perms", "0755", "--tmpfs", path]
    # Mount back what the interpreter needs from under a hidden path (a Python under /root/.pyenv),
    # with the directories on the way made traversable for `nobody`.
    for path in hidden:
        if _inside(prefix, path) and prefix != path:
            parts = os.path.relpath(prefix, path).split(os.sep)
            for k in range(1, len(parts)):
                argv += ["--perms", "0755", "--dir", os.path.join(path, *parts[:k])]
            argv += ["--ro-bind", prefix, prefix]
    argv += ["--perms", "0755", "--dir", SCRATCH_INSIDE, "--bind", scratch, SCRATCH_INSIDE]
    for path in hidden:  # the empty tmpfs layers: read-only too (remounting a path leaves its submounts)
        argv += ["--remount-ro", path]
    return argv + ["--chdir", SCRATCH_INSIDE, "--"]


# What the interpreter itself needs (shared libraries, ld.so's cache, locales): never hidden, nor
# any directory holding one of them (a working directory of "/" or "/usr").
_SYSTEM_PATHS = ("/bin", "/etc", "/lib", "/lib32", "/lib64", "/sbin", "/usr")


def _hidden_paths(cfg: SandboxConfig, prefix: str) -> list[str]:
    """The paths under an empty tmpfs: `HIDDEN_PATHS`, the caller's working directory, `cfg.hide`;
    not one that holds a system directory, that is the interpreter's prefix, or that lies inside it
    (a prefix inside a hidden path is mounted back instead)."""
    candidates = list(HIDDEN_PATHS) + [os.getcwd()] + list(cfg.hide)
    if "/tmp" not in candidates:
        candidates.append("/tmp")  # SCRATCH_INSIDE lives on it
    out: list[str] = []
    for path in candidates:
        path = os.path.realpath(path)
        if (not os.path.isdir(path) or any(_inside(system, path) for system in _SYSTEM_PATHS)
                or _inside(path, prefix) or any(_inside(path, p) for p in out)):
            continue
        out = [p for p in out if not _inside(p, path)] + [path]
    return sorted(out)


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _task_count(uid: int) -> int:
    """Threads of all processes of `uid` (what the kernel compares with RLIMIT_NPROC)."""
    count = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid_line = re.search(r"^Uid:\s+(\d+)", status, re.M)
        threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
        if uid_line and int(uid_line.group(1)) == uid:
            count += int(threads.group(1)) if threads else 1
    return count


def _execute(argv: list[str], cwd: str, stdin: bytes, cfg: SandboxConfig, namespaces: bool,
             supervised: bool = False) -> ExecResult:
    start = time.monotonic()
    status_r, status_w = os.pipe() if supervised else (-1, -1)
    try:  # stdin through a pipe, never a file: what the program has read is gone (hidden test data)
        proc = subprocess.Popen(argv + ([str(status_w)] if supervised else []), cwd=cwd, env={},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True, pass_fds=(status_w,) if supervised else ())
    except OSError as exc:
        if supervised:
            os.close(status_r)
        return ExecResult("", f"could not start the sandbox: {exc}", None, False, "sandbox_error",
                          namespaces=namespaces)
    finally:
        if supervised:
            os.close(status_w)
    deadline = start + cfg.timeout_s
    out, err = bytearray(), bytearray()
    reason, truncated = None, False
    try:
        reason, truncated = _read_until_done(proc, stdin, out, err, deadline, cfg.max_output_bytes)
        if reason is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # closed its output but runs on
                reason = "timeout"
    finally:
        if reason is not None or proc.poll() is None:
            _kill(proc, supervised)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:  # stdin: a broken pipe on the flush of a program that is gone
                pass
        report = _read_status(status_r) if supervised else {}
    duration = time.monotonic() - start
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    returncode = proc.returncode
    isolation = tuple(report.get("layers", ()))
    if supervised:
        if "refused" in report:
            raise SandboxUnavailable(f"refusing to run model-written code without bwrap: {report['refused']}; "
                                     "install bubblewrap (apt-get install bubblewrap)")
        if "status" in report:
            returncode = os.waitstatus_to_exitcode(report["status"])
        elif reason is None:
            reason = "sandbox_error"  # the supervisor itself died
    if namespaces and returncode is not None and returncode > 128 and reason is None:
        returncode = -(returncode - 128)  # bwrap exits 128 + N for a child killed by signal N
    if reason is None:
        reason = _exit_reason(returncode, stderr, namespaces)
    return ExecResult(stdout, stderr, returncode, reason == "timeout", reason, truncated, duration, namespaces,
                      isolation)


def _read_status(fd: int) -> dict[str, Any]:
    """The supervisor's report: its first "layers"/"refused" line and first "status" line."""
    data = bytearray()
    try:
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    report: dict[str, Any] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        for key, value in item.items():
            report.setdefault(key, value)
    return report


def _read_until_done(proc, stdin: bytes, out: bytearray, err: bytearray, deadline: float,
                     cap: int) -> tuple[str | None, bool]:
    """Feed stdin and read stdout and stderr in chunks until both close; stop early at the deadline
    or the cap. One loop for all three: a program that does not read its input cannot block us."""
    pending = memoryview(stdin)
    with selectors.DefaultSelector() as selector:
        for stream, buffer in ((proc.stdout, out), (proc.stderr, err)):
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ, buffer)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin, selectors.EVENT_WRITE, None)
        else:
            proc.stdin.close()
        while any(key.events & selectors.EVENT_READ for key in selector.get_map().values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout", False
            for key, _ in selector.select(timeout=remaining):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[:_CHUNK]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it exited or closed its input: the rest is not wanted
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(key.fd, _CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = key.data
                room = cap - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    return "output_limit", True
    return None, False


def _kill(proc: subprocess.Popen, supervised: bool = False) -> None:
    if supervised:  # the supervisor kills every descendant of its own, then exits
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10.0)
            return
        except subprocess.TimeoutExpired:
            logger.warning("sandbox supervisor %d did not exit 10 s after SIGTERM; killing its process group", proc.pid)
    try:  # start_new_session: the child leads its own process group (bwrap kills its PID namespace with it)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


_REFUSALS = (
    (re.compile(r"^MemoryError\b"), "memory"),
    (re.compile(r"\[Errno %d\]" % errno.EAGAIN), "processes"),
    (re.compile(r"\[Errno %d\]" % errno.EMFILE), "open_files"),
    (re.compile(r"\[Errno %d\]" % errno.EFBIG), "file_size"),
    (re.compile(r"\[Errno (%d|%d|%d)\]" % (errno.EROFS, errno.EACCES, errno.EPERM)), "denied"),
    (re.compile(r"\[Errno (%d|%d|%d|%d|-\d+)\]" % (  # negative: getaddrinfo's codes (no name resolution)
        errno.ENETUNREACH, errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL)), "network"),
)


def _exit_reason(returncode: int | None, stderr: str, namespaces: bool) -> str | None:
    if returncode is None or returncode == 0:
        return None
    if returncode < 0:
        number = -returncode
        if number == signal.SIGXCPU:
            return "cpu_time"
        try:
            return f"signal:{signal.Signals(number).name}"
        except ValueError:
            return f"signal:{number}"
    if namespaces and returncode == 1 and stderr.startswith("bwrap:"):
        return "sandbox_error"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if lines:
        last = lines[-1].strip()
        for pattern, reason in _REFUSALS:
            if pattern.search(last):
                return reason
    return None


def _probe_bwrap() -> tuple[bool, str]:
    """Run a program through the whole namespace sandbox once; (works, why not)."""
    if shutil.which("bwrap") is None:
        return False, "bwrap is not installed"
    try:
        result = _run("print('ok')", "", {}, SandboxConfig(timeout_s=30.0), True)
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    if result.stdout != "ok\n":
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        logger.warning("bwrap is installed but a program in its sandbox failed: %s", why)
        return False, f"bwrap failed: {why}"
    return True, ""


__all__ = ["ExecResult", "HIDDEN_PATHS", "SandboxConfig", "SandboxUnavailable", "bwrap_available",
           "check_namespaces", "run_many", "run_python", "unsandboxed_layers"]

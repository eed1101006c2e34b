"""Hostile programs against `run_python`, run twice: inside bwrap's namespaces, and with bwrap hidden
from PATH and `allow_unsandboxed: true` (the supervisor's layers alone; docs/sandbox.md). Each attack
must leave the host as it was: no file written outside the scratch directory, no secret read, no
connection made, no signal received by the test process, no process left behind.

The `bwrap` runs are skipped where bwrap does not work; the unsandboxed ones need a caller that can
drop to `nobody` (root, as in CI) or a user namespace, and a network namespace for the network attack.
"""

import errno
import os
import signal
import socket
import tempfile
import time

import pytest

from rljax.environments import sandbox
from rljax.environments.sandbox import SandboxUnavailable, run_python
from tests._processes import processes_with


def _bwrap_works() -> bool:
    sandbox._BWRAP_STATE.update(ok=None, why="")
    return sandbox.bwrap_available()


@pytest.fixture
def hide_bwrap(monkeypatch, tmp_path):
    """bwrap gone from PATH (an empty directory), and the cached probes forgotten before and after."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    saved = dict(sandbox._BWRAP_STATE), dict(sandbox._PLAIN_STATE)
    sandbox._BWRAP_STATE.update(ok=None, why="")
    sandbox._PLAIN_STATE.update(layers=None, refused="")
    yield
    sandbox._BWRAP_STATE.update(saved[0])
    sandbox._PLAIN_STATE.update(saved[1])


@pytest.fixture(params=["bwrap", "unsandboxed", "unsandboxed_no_pid_namespace"])
def mode(request, monkeypatch):
    """The settings of one run: {} with bwrap, `allow_unsandboxed: true` with bwrap hidden from PATH;
    the last also without the supervisor's PID namespace (where the kernel refuses one), so that the
    subreaper's own kill of every descendant is what is tested."""
    if request.param == "bwrap":
        if not _bwrap_works():
            pytest.skip("bwrap (bubblewrap) is not usable here")
        return {}
    request.getfixturevalue("hide_bwrap")
    if request.param == "unsandboxed_no_pid_namespace":
        assert sandbox._SUPERVISOR.count("libc.unshare(NEWPID) == 0") == 1
        monkeypatch.setattr(sandbox, "_SUPERVISOR", sandbox._SUPERVISOR.replace("libc.unshare(NEWPID) == 0", "False"))
    assert not sandbox.bwrap_available()
    try:
        layers = sandbox.unsandboxed_layers()
    except SandboxUnavailable as exc:  # the refusal is the guarantee where no unprivileged run is possible
        assert "apt-get install bubblewrap" in str(exc)
        assert "probe program failed" not in str(exc)  # a broken supervisor is a failure, not a skip
        pytest.skip(f"without bwrap the sandbox refuses here: {exc}")
    assert ("pid" in layers) == (request.param == "unsandboxed") or os.geteuid() != 0
    return {"allow_unsandboxed": True}


def _config(mode, **settings):
    return {"timeout_s": 5.0, **mode, **settings}  # generous: the host may be loaded; attacks end early


def _none_left(marker, wait_s=5.0):
    deadline = time.monotonic() + wait_s  # SIGKILL is asynchronous: give the kernel a moment
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return processes_with(marker) == []


def test_without_bwrap_and_without_the_flag_a_run_is_refused(hide_bwrap):
    with pytest.raises(SandboxUnavailable, match=r"bwrap \(bubblewrap\) is not usable here.*apt-get install "
                                                 r"bubblewrap.*allow_unsandboxed: true"):
        run_python("print('ran')", config={"timeout_s": 2.0})


def test_writes_to_etc_and_to_the_project_are_refused(mode):
    project = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
    targets = [f"/etc/rljax-attack-{os.getpid()}", os.path.join(project, f"rljax-attack-{os.getpid()}"),
               os.path.join(os.getcwd(), f"rljax-attack-cwd-{os.getpid()}")]
    try:
        for path in targets:
            result = run_python(f"open({path!r}, 'w').write('x')\nprint('wrote')", config=_config(mode))
            assert result.stdout == "" and result.returncode == 1, (path, result)
            assert result.killed_reason == "denied" or "FileNotFoundError" in result.stderr, (path, result)
            assert not os.path.exists(path)
    finally:
        for path in targets:
            if os.path.exists(path):
                os.remove(path)


def test_secrets_in_home_and_root_only_files_are_not_read(mode):
    home = os.path.realpath(os.path.expanduser("~"))
    fd, in_home = tempfile.mkstemp(prefix="rljax-attack-secret-", dir=home)
    os.write(fd, b"hunter2-home")
    os.close(fd)
    folder = tempfile.mkdtemp(prefix="rljax-attack-", dir="/var/tmp")  # a folder anyone may enter...
    os.chmod(folder, 0o755)
    private = os.path.join(folder, "secret")
    with open(private, "w") as f:
        f.write("hunter2-private")
    os.chmod(private, 0o600)  # ...holding a file only its owner may read
    try:
        for path in (in_home, private):
            result = run_python(f"print(open({path!r}).read())", config=_config(mode))
            assert "hunter2" not in result.stdout + result.stderr, (path, result)
            assert result.returncode == 1 and ("PermissionError" in result.stderr
                                               or "FileNotFoundError" in result.stderr), (path, result)
    finally:
        os.remove(in_home)
        os.remove(private)
        os.rmdir(folder)


def test_a_connection_to_a_server_on_the_loopback_is_refused(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        result = run_python(code, config=_config(mode))
        if not result.namespaces and "net" not in result.isolation:
            pytest.skip(f"no network namespace without bwrap here (layers: {result.isolation})")
        assert result.stdout == "" and result.killed_reason == "network", result
        with pytest.raises(BlockingIOError):
            server.accept()


def test_the_program_cannot_signal_the_trainer(mode):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: received.append(number))
    try:
        code = (
            "import os, signal\n"
            f"for pid in (os.getppid(), {os.getpid()}, {os.getppid()}):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGTERM)\n"
            "        print(pid, 0)\n"
            "    except OSError as e:\n"
            "        print(pid, e.errno)\n"
        )
        result = run_python(code, config=_config(mode))
        time.sleep(0.2)  # a signal that was sent has arrived by now
        assert received == []
        assert result.returncode == 0, result
        outcomes = [int(line.split()[1]) for line in result.stdout.splitlines()]
        assert len(outcomes) == 3 and set(outcomes) <= {errno.EPERM, errno.ESRCH}, result.stdout
    finally:
        signal.signal(signal.SIGTERM, previous)


def _detached_children(marker, count):
    """A program that double-forks `count` grandchildren, each in a session of its own (setsid) and
    sleeping or spinning for a minute under a command line holding `marker`."""
    return (
        "import os, sys\n"
        f"for i in range({count}):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            body = 'import time; time.sleep(60)' if i % 2 else 'while True: pass'\n"
        f"            os.execv(sys.executable, [sys.executable, '-c', body, {marker!r}])\n"
        "        os._exit(0)\n"
        "    os.wait()\n"
        "print('spawned', flush=True)\n"
    )


def test_detached_descendants_are_all_killed_at_the_timeout(mode):
    marker = f"rljax-attack-detached-{os.getpid()}"
    code = _detached_children(marker, 24) + "import time\ntime.sleep(60)\n"
    result = run_python(code, config=_config(mode, timeout_s=3.0, max_processes=64))
    assert result.stdout == "spawned\n", result
    assert result.killed_reason == "timeout" and result.timed_out and result.returncode == -9
    assert _none_left(marker)


def test_detached_descendants_are_killed_when_the_program_exits(mode):
    marker = f"rljax-attack-exited-{os.getpid()}"
    result = run_python(_detached_children(marker, 24), config=_config(mode, max_processes=64))
    assert result.stdout == "spawned\n" and result.returncode == 0, result
    assert _none_left(marker)


def test_a_fork_bomb_is_bounded_and_killed(mode):
    marker = f"rljax-attack-bomb-{os.getpid()}"
    code = (
        "import os, sys\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        print(n, e.errno, flush=True)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        os.setsid()\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {marker!r}])\n"
        "    n += 1\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        f"            os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {marker!r}])\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = run_python(code, config=_config(mode, timeout_s=1.5, max_processes=8, max_concurrent=2))
    assert result.killed_reason == "timeout" and result.timed_out, result
    forks, error = map(int, result.stdout.split()[:2])
    assert error == errno.EAGAIN and forks < 8 * 2, result.stdout
    assert _none_left(marker)
    assert run_python("print(6 * 7)", config=_config(mode)).stdout == "42\n"

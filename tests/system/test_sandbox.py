"""The Python sandbox: each hostile program is stopped or refused, named in `killed_reason`, and the
caller goes on (every test ends by running a good program, or its successor does).

Tests that need bwrap's namespaces are skipped where it does not work (.ci/run installs it).
Timeouts are short (1 s) to keep the file within a few seconds.
"""

import os
import socket
import sys

import pytest

from rljax.environments.sandbox import (
    SandboxConfig,
    SandboxUnavailable,
    bwrap_available,
    run_many,
    run_python,
)

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bwrap (bubblewrap) is not usable here")
FAST = {"timeout_s": 1.0}


def _still_works():
    result = run_python("print(6 * 7)", config=FAST)
    assert (result.stdout, result.returncode, result.killed_reason) == ("42\n", 0, None)


def test_large_stdin_is_fed_while_output_is_read():
    # 1 MB in, 1 MB out: more than a pipe holds either way, so feeding and reading must interleave.
    code = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line.upper())"
    text = "abcdefghi\n" * 100_000
    result = run_python(code, stdin=text, timeout_s=10.0, config={"max_output_bytes": 2 << 20})
    assert result.returncode == 0 and result.stdout == text.upper()
    ignored = run_python("print('done')", stdin=text, config=FAST)  # never reads it: no hang, no error
    assert (ignored.stdout, ignored.returncode, ignored.killed_reason) == ("done\n", 0, None)


def test_output_stdin_and_files_round_trip():
    code = "import sys\nprint(sys.stdin.read().upper(), open('data/a.txt').read(), end='')\nsys.exit(3)"
    result = run_python(code, stdin="hello", files={"data/a.txt": "world"}, config=FAST)
    assert result.stdout == "HELLO world"  # stdin read whole, the file beside main.py
    assert (result.returncode, result.timed_out, result.killed_reason) == (3, False, None)


def test_the_environment_is_empty_and_the_scratch_directory_is_fresh_and_deleted(monkeypatch):
    monkeypatch.setenv("RLJAX_TEST_TOKEN", "s3cret")
    code = ("import os\nprint(sorted(os.environ), sorted(os.listdir('.')))\nprint(os.getcwd())\n"
            "open('out.txt', 'w').write('x')")
    first = run_python(code, config=FAST)
    second = run_python(code, config=FAST)
    assert first.returncode == 0 and first.stdout == second.stdout  # nothing left by the first run
    names, cwd = first.stdout.splitlines()
    # Only what bwrap (PWD, of --chdir) and the interpreter itself (LC_CTYPE, PEP 538) set: nothing inherited.
    assert set(eval(names.split("] ")[0] + "]")) <= {"PWD", "LC_CTYPE"}
    assert names.endswith("['main.py']")
    if not first.namespaces:
        assert not os.path.exists(cwd)


def test_infinite_loop_and_a_program_that_ignores_sigterm_are_killed_at_the_timeout():
    loop = "while True:\n    pass"
    stubborn = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ignoring', flush=True)\ntime.sleep(60)")
    looped, ignored = run_many([loop, stubborn], config={"timeout_s": 1.0, "max_concurrent": 2})  # side by side
    for result in (looped, ignored):
        assert result.timed_out and result.killed_reason == "timeout" and result.returncode == -9
        assert result.duration_s >= 1.0
    assert ignored.stdout == "ignoring\n"  # output before the kill is kept
    _still_works()


def test_memory_bomb_is_refused():
    result = run_python("x = bytearray(2 << 30)\nprint('allocated')", memory_mb=64, timeout_s=2.0)
    assert result.stdout == "" and result.killed_reason == "memory"
    assert result.stderr.strip().endswith("MemoryError") and result.returncode == 1
    _still_works()


def test_huge_output_is_truncated_at_the_cap_and_the_run_stopped():
    code = "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)"
    result = run_python(code, config={**FAST, "max_output_bytes": 100_000})
    assert result.killed_reason == "output_limit" and result.output_truncated and not result.timed_out
    assert result.stdout == "y" * 100_000
    _still_works()


def test_a_big_file_is_refused():
    result = run_python("open('big', 'wb').write(b'0' * (3 << 20))", config={**FAST, "max_file_mb": 1})
    assert result.killed_reason == "file_size" and "File too large" in result.stderr


def test_concurrent_runs_respect_the_bound():
    # Each program prints when it started and ended; at most 2 of 4 may overlap, and 2 do.
    code = "import time\na = time.time()\ntime.sleep(0.4)\nprint(a, time.time())"
    results = run_many([code] * 4, config={"timeout_s": 5.0, "max_concurrent": 2})
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    assert len(spans) == 4
    overlap = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert overlap == 2


def test_settings_are_checked_with_their_names():
    with pytest.raises(ValueError, match=r"sandbox: unknown setting\(s\) 'timeout'"):
        SandboxConfig.from_options({"timeout": 1})
    with pytest.raises(ValueError, match="rewards.code.sandbox.memory_mb must be a positive integer"):
        SandboxConfig.from_options({"memory_mb": 0}, key="rewards.code.sandbox")
    with pytest.raises(ValueError, match="not a relative path"):
        run_python("pass", files={"../escape.py": "x"})


def test_without_namespaces_a_run_is_refused_unless_allowed():
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap.*apt-get install bubblewrap.*allow_unsandboxed: true"):
        run_python("print(1)", config={"use_namespaces": False})
    with pytest.raises(ValueError, match=r"sandbox.require_namespaces is no longer a setting.*allow_unsandboxed"):
        run_python("print(1)", config={"require_namespaces": True})


def test_without_namespaces_the_other_layers_still_hold():
    cfg = {"use_namespaces": False, "allow_unsandboxed": True, "timeout_s": 0.5}
    assert run_python("print(1)", config={**cfg, "timeout_s": 5.0}).stdout == "1\n"
    result = run_python("while True:\n    pass", config=cfg)
    assert result.killed_reason == "timeout" and not result.namespaces
    result = run_python("x = bytearray(2 << 30)", config={**cfg, "memory_mb": 64, "timeout_s": 5.0})
    assert result.killed_reason == "memory"


@needs_bwrap
def test_writing_outside_the_scratch_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for path in ("/etc/rljax-escaped", "/usr/lib/rljax-escaped", str(target)):
        result = run_python(f"open({path!r}, 'w').write('x')\nprint('wrote')", config=FAST)
        assert result.stdout == "" and result.returncode == 1
        assert result.killed_reason in {"denied"} or "FileNotFoundError" in result.stderr  # hidden: not there
        assert not os.path.exists(path)
    result = run_python("open('/etc/rljax-escaped', 'w')", config=FAST)
    assert result.killed_reason == "denied" and "Read-only file system" in result.stderr


@needs_bwrap
def test_a_secret_outside_the_scratch_directory_is_not_visible(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    home = os.path.realpath(os.path.expanduser("~"))
    # Under a hidden home only the interpreter's installation is mounted back (a Python in ~/.pyenv).
    prefix = os.path.realpath(sys.base_prefix)
    shown = [os.path.relpath(prefix, home).split(os.sep)[0]] if prefix.startswith(home + os.sep) else []
    code = (f"import os\nprint(os.path.exists({str(secret)!r}), os.listdir({home!r}), "
            f"os.path.exists({os.getcwd()!r} + '/pyproject.toml'))\nprint(open({str(secret)!r}).read())")
    result = run_python(code, config=FAST)
    assert result.stdout == f"False {shown} False\n"
    assert "hunter2" not in result.stdout + result.stderr
    assert "FileNotFoundError" in result.stderr


@needs_bwrap
def test_network_connections_are_refused():
    with socket.socket() as server:  # a listener on the host's loopback: the sandbox has its own
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        result = run_python(code, config=FAST)
        assert result.stdout == "" and result.killed_reason == "network"
        with pytest.raises(BlockingIOError):
            server.accept()
    result = run_python("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)", config=FAST)
    assert result.killed_reason == "network"


@needs_bwrap
def test_killing_the_parent_is_refused():
    code = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('sent')"
    result = run_python(code, config=FAST)
    assert result.killed_reason == "denied" and "Operation not permitted" in result.stderr
    _still_works()


def test_bwrap_command_line_isolates_everything_and_drops_privileges(monkeypatch):
    from rljax.environments.sandbox import _bwrap_argv, _hidden_paths

    prefix = os.path.realpath(sys.base_prefix)
    cfg = SandboxConfig()
    for root in (True, False):
        argv = _bwrap_argv("/tmp/rljax-sandbox-x", prefix, cfg, root)
        pairs = list(zip(argv, argv[1:]))
        assert "--die-with-parent" in argv and "--new-session" in argv
        assert ("--ro-bind", "/") in pairs and ("--tmpfs", "/tmp") in pairs  # read-only host, private /tmp
        assert ("--remount-ro", "/tmp") in pairs and ("--bind", "/tmp/rljax-sandbox-x") in pairs
        assert argv[-3:] == ["--chdir", "/tmp/sandbox", "--"]
        if root:  # the host's user namespace, where the bootstrap can drop to nobody (see the module docstring)
            assert {"--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"} <= set(argv)
            assert "--unshare-user" not in argv and "--uid" not in argv
        else:
            assert "--unshare-all" in argv and ("--uid", "65534") in pairs and ("--gid", "65534") in pairs
    assert "/root" in _hidden_paths(cfg, prefix) or not os.path.isdir("/root")

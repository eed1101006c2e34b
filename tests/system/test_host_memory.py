"""The glibc malloc settings (rljax/host_memory.py): `import rljax` leaves malloc alone, the call applies them.

(The test suite itself runs with them off: tests/conftest.py. Each check runs in a fresh process.)
"""

import os
import platform
import subprocess
import sys

import pytest

from rljax import host_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
# Everything rljax's top-level package and the CLI module import, then the state of the settings.
IMPORT_ONLY = "import rljax, rljax.tools.cli, rljax.host_memory as h; print(h.applied())"
IMPORT_AND_CALL = "import rljax.host_memory as h; print(h.keep_host_memory(), h.applied())"


def _in_a_fresh_process(probe: str, switch: str) -> str:
    env = {**os.environ, host_memory.ENV_SWITCH: switch}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_leaves_malloc_untouched():
    assert _in_a_fresh_process(IMPORT_ONLY, "1") == "None"


@pytest.mark.skipif(not GLIBC, reason="the settings exist only for glibc's malloc")
def test_the_call_applies_the_settings_and_the_switch_turns_them_off():
    assert _in_a_fresh_process(IMPORT_AND_CALL, "1") == "True True"
    assert _in_a_fresh_process(IMPORT_AND_CALL, "0") == "False False"
    assert host_memory.applied() in (None, False)  # this process: tests/conftest.py switched them off


@pytest.mark.skipif(not GLIBC, reason="the settings exist only for glibc's malloc")
def test_the_cli_applies_them_for_online_runs_only(tmp_path):
    """Online train / eval: applied (before the model is loaded, which fails here); offline runs (their
    batches change width step to step, and the never-trimmed heap grew: rljax.tools.cli) and convert: not."""
    online, offline = tmp_path / "online.yaml", tmp_path / "offline.yaml"
    online.write_text("model: {name: /nonexistent/model}\nrewards: {format: 1.0}\n")
    offline.write_text("model: {name: /nonexistent/model}\nalgorithm: {name: sft}\n"
                       "data: {task: '', path: /nonexistent/train.jsonl}\n")
    probe = ("import rljax.tools.cli as c, rljax.host_memory as h\n"
             "try:\n    c.main({argv!r})\n"
             "except (Exception, SystemExit):\n    pass\n"
             "print(h.applied())")
    run_dir = f"train.run_dir={tmp_path / 'run'}"
    assert _in_a_fresh_process(probe.format(argv=["train", str(online), run_dir]), "1") == "True"
    assert _in_a_fresh_process(probe.format(argv=["eval", str(online), run_dir]), "1") == "True"
    assert _in_a_fresh_process(probe.format(argv=["train", str(offline), run_dir]), "1") == "None"
    assert _in_a_fresh_process(probe.format(argv=["convert", "/nonexistent/a", "/nonexistent/b"]), "1") == "None"


@pytest.mark.skipif(not GLIBC, reason="the settings exist only for glibc's malloc")
def test_one_rule_for_runs_online_keeps_offline_does_not_and_the_fit_loop_follows_it():
    """``keep_host_memory_for_run`` is the one owner: the CLI and ``rljax.training.loop.fit`` (a script
    that trains without the CLI) both call it, so an offline run started either way leaves malloc alone."""
    call = "import rljax.host_memory as h; print(h.keep_host_memory_for_run({online}), h.applied())"
    assert _in_a_fresh_process(call.format(online=True), "1") == "True True"
    assert _in_a_fresh_process(call.format(online=False), "1") == "False None"
    import inspect

    from rljax.training import loop

    source = inspect.getsource(loop._fit)
    assert "keep_host_memory_for_run(trainer.run.cfg.is_online)" in source and "keep_host_memory()" not in source

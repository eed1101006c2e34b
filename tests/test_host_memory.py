"""rljax's import applies the glibc malloc settings (rljax/host_memory.py) unless switched off.

(The test suite itself runs with them off: tests/conftest.py.)
"""

import os
import platform
import subprocess
import sys

import pytest

from rljax import host_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
PROBE = "import rljax.host_memory as h; print(h._applied)"  # what `import rljax` did


def _applied_in_a_fresh_process(switch: str) -> str:
    env = {**os.environ, host_memory.ENV_SWITCH: switch}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="the settings exist only for glibc's malloc")
def test_import_applies_the_settings_and_the_switch_turns_them_off():
    assert _applied_in_a_fresh_process("1") == "True"
    assert _applied_in_a_fresh_process("0") == "False"
    assert host_memory._applied is False  # this process: tests/conftest.py switched them off

"""``rljax.compile_cache`` across processes: a second ``rljax generate`` of the same shapes on the
rollout engine loads every compiled program from the cache (it writes no new entry) and samples the
same tokens."""

import os
import subprocess
import sys

from tests._tiny import make_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generate(model, cache, *, rljax_cache=None):
    # without the test run's own cache (tests/conftest.py): JAX's variable would win over rljax's
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, RLJAX_COMPILATION_CACHE=rljax_cache or str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # the tiny model's programs compile fast
    done = subprocess.run([sys.executable, "-m", "rljax", "generate", "--model", str(model), "--prompt", "2+3=",
                           "--prompt", "12+35=", "--temperature", "1", "--seed", "3", "--max-new-tokens", "6",
                           "--engine", "paged", "--max-slots", "4"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=900)  # a hang guard, not a time limit
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_second_run_loads_every_program_from_the_cache(tmp_path):
    model = make_tiny_model_dir(tmp_path / "model")
    cache = tmp_path / "cache"
    first = _generate(model, cache)
    entries = sorted(p for p in os.listdir(cache) if not p.startswith("."))
    assert any(p.startswith("jit_decode-") for p in entries) and any(p.startswith("jit_prefill-") for p in entries), \
        entries
    second = _generate(model, cache)
    assert sorted(p for p in os.listdir(cache) if not p.startswith(".")) == entries  # nothing compiled again
    assert second == first
    # RLJAX_COMPILATION_CACHE=0: no cache written
    off = tmp_path / "off"
    assert _generate(model, off, rljax_cache="0") == first
    assert not off.exists()

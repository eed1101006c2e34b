"""Test-wide settings: no silent rank promotion, float32 matmuls at full precision, glibc's default malloc.

The suite compiles hundreds of small programs in one process, which ran slower with rljax's
host-memory settings (tests/test_train.py: 137 s with them, 109 s without; rljax/host_memory.py),
so they are off here (``rljax.cli.main`` and the scripts call ``keep_host_memory``, which reads this
switch); tests/test_host_memory.py checks them in subprocesses.
"""
import os

os.environ.setdefault("RLJAX_KEEP_HOST_MEMORY", "0")
# the end-of-run RUN_DIR/curves.png (rljax.training.loop) costs 2-4 s of matplotlib on this CPU per
# run, over a hundred runs here; tests/test_plots.py turns it back on where it is what is tested
os.environ.setdefault("RLJAX_PLOT", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's caches of compiled programs.

    Every XLA:CPU executable keeps its machine code in memory mappings of its own, and one process
    running the whole suite compiled enough of them to pass Linux's limit of 65,530 mappings per
    process (``vm.max_map_count``): measured, 13,800 mappings after 3 minutes of the first test
    files, and the suite then died with a segmentation fault inside XLA's compiler (an mmap that
    failed) at the same test in two full runs, never in a shorter run. With this fixture the same
    files stayed between 800 and 4,200 mappings. The cost: a module that runs the shapes of an
    earlier one compiles them again.
    """
    yield
    jax.clear_caches()
    gc.collect()

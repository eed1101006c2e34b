"""Test-wide settings: no silent rank promotion, float32 matmuls at full precision, glibc's default malloc.

The suite compiles hundreds of small programs in one process, which ran slower with rljax's
host-memory settings (tests/test_train.py: 137 s with them, 109 s without; rljax/host_memory.py),
so they are off here (``rljax.tools.cli.main`` and the scripts call ``keep_host_memory``, which reads this
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


@pytest.fixture(scope="session")
def paper_repro_cache(tmp_path_factory, worker_id):
    """One cache folder of the reproductions' pretrained smoke policies for the whole test run.

    The arithmetic policy (``_arith_policy``: dr_grpo, dapo, rloo_vs_ppo, online_vs_offline) and the
    sentiment reference (``_sentiment_corpus``: dpo frontier, reward over-optimisation) were each
    pretrained once per test file that ran a --smoke preset, 25-40 s apiece. The folder is shared by
    the xdist workers (the parent of their base temp folders) and built under a file lock, so the
    first worker to ask trains and every later caller finds it cached.
    """
    import sys

    from filelock import FileLock

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "paper_repro"))
    import _arith_policy as ap
    import _sentiment_corpus as corpus

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "paper_repro_cache"
    root.mkdir(exist_ok=True)
    with FileLock(str(root) + ".lock"):
        ap.pretrain_policy(ap.PolicySpec.smoke(), str(root), log=lambda _: None)
        corpus.pretrain_reference(corpus.SMOKE_PRETRAIN, cache=root, log=lambda _: None)
    return str(root)

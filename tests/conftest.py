"""Test-wide settings: no silent rank promotion, float32 matmuls at full precision, glibc's default malloc,
XLA's backend optimisation level 0, one persistent compilation cache per test run (or one kept across
runs), torch on one thread.

The suite compiles hundreds of small programs in one process, which ran slower with rljax's
host-memory settings (tests/integration/test_train.py: 137 s with them, 109 s without; rljax/host_memory.py),
so they are off here (``rljax.tools.cli.main`` and the scripts call ``keep_host_memory``, which reads this
switch); tests/system/test_host_memory.py checks them in subprocesses.
"""
import os

os.environ.setdefault("RLJAX_KEEP_HOST_MEMORY", "0")
# the end-of-run RUN_DIR/curves.png (rljax.training.loop) costs 2-4 s of matplotlib on this CPU per
# run, over a hundred runs here; tests/integration/test_plots.py turns it back on where it is what is tested
os.environ.setdefault("RLJAX_PLOT", "0")
# torch (the transformers references) on one thread: the suite's two workers already keep both cores
# busy, and torch's OpenMP threads spin-waiting beside XLA's cost CPU (docs/testing.md). Set before torch
# is imported, inherited by subprocesses; the benchmarks set their thread count themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# JAX's persistent compilation cache, one new directory per test run, shared by the xdist workers and
# every subprocess they start (they inherit it from the process that imported this file first), removed
# at its end: tests that build equal programs in different processes or trainers load them instead of
# compiling them again (measured in docs/testing.md, "JAX's persistent compilation cache"). Never the
# user's ~/.cache (rljax.compile_cache): JAX's variable wins over rljax's.
# RLJAX_TEST_COMPILATION_CACHE=0 runs without it; RLJAX_TEST_COMPILATION_CACHE=DIR keeps it in DIR across
# runs (a contributor's rerun loads what the last run compiled; JAX's key holds the program, its compile
# options and the jax version, so a changed program compiles again).
os.environ.setdefault("RLJAX_COMPILATION_CACHE", "0")
_TEST_CACHE = os.environ.get("RLJAX_TEST_COMPILATION_CACHE", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and _TEST_CACHE != "0":
    if _TEST_CACHE == "1":
        import atexit
        import shutil
        import tempfile

        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rljax-test-jax-cache-")
        atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(os.path.expanduser(_TEST_CACHE))
        # no size cap: with one, JAX rescans the whole directory under a file lock at every write
        # (docs/testing.md); a whole run writes under 100 MB, and deleting DIR starts afresh
    # the tiny models' programs compile in well under JAX's default second
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Most of a tiny-model test's time is XLA:CPU compiling, not running: the backend's optimisation level
# 0 compiles with fewer LLVM passes (docs/testing.md). Before jax is imported, and inherited by every
# subprocess (tests._processes.xla_flags keeps it where a test sets its own device count).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


import functools  # noqa: E402
import gc  # noqa: E402

import pytest  # noqa: E402

from tests import _tiny  # noqa: E402


def _memory_mappings():
    """The number of memory mappings of this process (lines of /proc/self/maps), or None off Linux."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _mapping_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


# Clear once a process holds this many mappings: half of Linux's limit, far above what one test
# module adds (a fresh worker held 2,870 after tests/integration/test_numbers.py and 2,729 after
# test_run_dir.py, from 504 with jax and rljax imported), so the next module cannot reach the limit.
MAPPINGS_BEFORE_CLEARING = _mapping_limit() // 2


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After a test module, drop JAX's caches of compiled programs once the process holds many mappings.

    Every XLA:CPU executable keeps its machine code in memory mappings of its own, and one process
    running the whole suite compiled enough of them to pass Linux's limit of 65,530 mappings per
    process (``vm.max_map_count``): the suite then died with a segmentation fault inside XLA's
    compiler (an mmap that failed). Clearing JAX's caches (and collecting) brings a process back to a
    few thousand mappings. Below :data:`MAPPINGS_BEFORE_CLEARING` the caches are kept, so a module
    that runs the shapes of an earlier module on the same worker does not compile them again; off
    Linux (no /proc) they are cleared after every module. ``RLJAX_TEST_MAPPINGS_LOG=path`` appends
    each module's count to ``path``.
    """
    yield
    count = _memory_mappings()
    log = os.environ.get("RLJAX_TEST_MAPPINGS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {request.module.__name__} {count}\n")
    if count is None or count > MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()


_COMPILE_LOG = os.environ.get("RLJAX_TEST_COMPILE_LOG")
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                  "/jax/core/compile/backend_compile_duration": "compile"}
"""JAX's compile-phase events (``jax.monitoring``) that ``RLJAX_TEST_COMPILE_LOG`` sums per test."""


if _COMPILE_LOG:
    import collections
    import resource
    import time

    from jax import monitoring

    _phase_seconds: collections.Counter = collections.Counter()  # per phase
    _programs: collections.Counter = collections.Counter()  # per compiled function: how many
    _program_seconds: collections.Counter = collections.Counter()  # per compiled function: compile seconds

    def _count_phase(event, duration_secs, **kwargs):
        name = COMPILE_EVENTS.get(event)
        if name:
            _phase_seconds[name] += duration_secs
        if name == "compile":  # JAX names the program (jit(update_epochs), ...): which functions compile how often
            fun = "".join(c if c.isalnum() or c in "_.()-" else "_" for c in str(kwargs.get("fun_name", "?")))
            _programs[fun] += 1
            _program_seconds[fun] += duration_secs

    monitoring.register_event_duration_secs_listener(_count_phase)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """``RLJAX_TEST_COMPILE_LOG=path``: append one tab-separated line per test to ``path``: its id,
        wall seconds, this process's CPU seconds, finished child processes' CPU seconds, and the seconds
        JAX spent tracing, lowering and compiling in this process, the number of programs compiled
        (or loaded from a persistent cache), and per compiled function ``name=count:seconds`` joined
        by ``;`` (``tests/durations.py --compile-log`` reads it)."""
        _phase_seconds.clear()
        _programs.clear()
        _program_seconds.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        yield
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        child_cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
        fields = [item.nodeid, time.perf_counter() - wall, time.process_time() - cpu, child_cpu,
                  *(float(_phase_seconds[name]) for name in COMPILE_EVENTS.values()), str(sum(_programs.values())),
                  ";".join(f"{fun}={n}:{_program_seconds[fun]:.3f}" for fun, n in sorted(_programs.items()))]
        with open(_COMPILE_LOG, "a") as f:
            f.write("\t".join(f"{x:.3f}" if isinstance(x, float) else x for x in fields) + "\n")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One random tiny model directory (``tests._tiny.make_tiny_model_dir``) for every test of a worker.

    Tests read it and never write into it; a test that needs another model (other sizes, a value
    head, a changed file) makes its own.
    """
    return _tiny.make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_run_config(tiny_dir):
    """``tiny_run_config(run_dir=None, **sections)``: ``tests._tiny.tiny_run_config`` on :func:`tiny_dir`."""
    return functools.partial(_tiny.tiny_run_config, tiny_dir)


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

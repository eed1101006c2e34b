"""Test-wide settings: no silent rank promotion, float32 matmuls at full precision, glibc's default malloc.

The suite compiles hundreds of small programs in one process, which ran slower with rljax's
host-memory settings (tests/test_train.py: 137 s with them, 109 s without; rljax/host_memory.py),
so they are off here (``rljax.cli.main`` and the scripts call ``keep_host_memory``, which reads this
switch); tests/test_host_memory.py checks them in subprocesses.
"""
import os

os.environ.setdefault("RLJAX_KEEP_HOST_MEMORY", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

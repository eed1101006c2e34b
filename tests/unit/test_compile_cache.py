"""Where the persistent compilation cache goes (``rljax.compile_cache.cache_dir``), and the engine's
default page pool, which must come out the same for runs on one host so the cache can serve them."""

import os

import pytest

from rljax.compile_cache import cache_dir
from rljax.inference import engine as engine_module


@pytest.mark.parametrize("environ,expected", [
    ({"HOME": "/home/r"}, "/home/r/.cache/rljax/jax"),
    ({"HOME": "/home/r", "XDG_CACHE_HOME": "/xdg"}, "/xdg/rljax/jax"),
    ({"HOME": "/home/r", "RLJAX_COMPILATION_CACHE": "/scratch/jc"}, "/scratch/jc"),
    ({"HOME": "/home/r", "RLJAX_COMPILATION_CACHE": "0"}, None),
    ({"HOME": "/home/r", "RLJAX_COMPILATION_CACHE": "off"}, None),
    # JAX's own variable wins, whatever rljax's says
    ({"HOME": "/home/r", "RLJAX_COMPILATION_CACHE": "0", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/j"),
])
def test_cache_dir(environ, expected, monkeypatch):
    monkeypatch.setenv("HOME", environ["HOME"])  # expanduser reads the process's HOME
    assert cache_dir(environ) == expected


@pytest.mark.parametrize("n,expected", [(0, 0), (3, 3), (4, 4), (7, 7), (9, 8), (11, 10), (15, 14), (17, 16),
                                        (23, 20), (6800, 6144), (5119, 4096), (8191, 7168), (8192, 8192)])
def test_coarse_rounds_down_to_four_steps_per_power_of_two(n, expected):
    assert engine_module._coarse(n) == expected


class _Engine:
    kv_bytes_per_token = 1 << 10
    page_size = 16
    max_slots = 64
    max_context = 8192


def test_the_default_pool_on_a_cpu_host_does_not_move_with_the_memory_available_now(monkeypatch):
    total = 24 << 30
    pages = []
    for available in (19.0, 20.5, 22.0):  # what other processes leave free varies from run to run
        monkeypatch.setattr(engine_module, "_host_memory_bytes", lambda a=available: (total, int(a * (1 << 30))))
        pages.append(engine_module.default_num_pages(_Engine(), ()))
    # a quarter of 24 GiB in 16 KiB pages = 393,216 pages, capped by 64 full contexts: 64 * 512 + 1
    assert pages == [32769] * 3
    _Engine.max_slots = 1024  # no cap: a quarter of total = 393,216 = 3 * 2**17, a step of _coarse
    try:
        pages = []
        for available in (19.0, 20.5, 22.0):
            monkeypatch.setattr(engine_module, "_host_memory_bytes", lambda a=available: (total, int(a * (1 << 30))))
            pages.append(engine_module.default_num_pages(_Engine(), ()))
        assert pages == [393216] * 3
        # little left: half of what is available, rounded down (5 GiB / 16 KiB = 327,680 -> 327,680 = 5 * 2**16)
        monkeypatch.setattr(engine_module, "_host_memory_bytes", lambda: (total, 10 << 30))
        assert engine_module.default_num_pages(_Engine(), ()) == 327680
        monkeypatch.setattr(engine_module, "_host_memory_bytes", lambda: (total, (10 << 30) + (1 << 29)))
        assert engine_module.default_num_pages(_Engine(), ()) == 327680  # 344,064 pages rounds to the same
    finally:
        _Engine.max_slots = 64

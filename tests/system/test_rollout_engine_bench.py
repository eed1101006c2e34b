"""experiments/perf/rollout_engine.py: its byte and length arithmetic by hand, and the --smoke preset end to
end in a subprocess (engine and static sampler on a tiny random model; the last line's format)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from rljax.buckets import bucket_length
from rljax.models.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "perf", "rollout_engine.py")
LAST_LINE = re.compile(r"rollout engine vs static sampler: (\d+\.\d\d)x useful tokens/s \(heavy-tailed\), "
                       r"(\d+\.\d\d)x \(uniform\); decode at (\d+)% of memory bandwidth")


def _bench():
    spec = importlib.util.spec_from_file_location("rollout_engine_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_bytes_per_token_and_per_decode_step_by_hand():
    bench = _bench()
    assert bench.kv_bytes_per_token(SMOLLM2) == 2 * 30 * 3 * 64 * 4 == 46080
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536  # q, k + v, o, gate + up + down
    assert per_layer == 3538944
    assert bench.decode_weight_bytes(SMOLLM2) == 4 * (30 * per_layer + 49152 * 576) == 537919488


def test_the_compute_ceiling_by_hand():
    # a decode step multiplies every weight it reads once per row: 2 FLOPs per multiply-add
    bench = _bench()
    params = 537919488 // 4
    assert bench.decode_flops(SMOLLM2, 16) == 2 * 16 * params == 4303355904
    assert bench.decode_flops(SMOLLM2, 64) == 4 * bench.decode_flops(SMOLLM2, 16)
    # 4.303 GFLOP at 100 GFLOP/s: a step of at least 43.0 ms, so 1 GB moved per step is at most 23.24 GB/s
    assert bench.compute_ceiling_gbs(SMOLLM2, 16, 1e9, 100.0) == pytest.approx(1e9 / 0.04303355904 / 1e9)
    assert bench.compute_ceiling_gbs(SMOLLM2, 16, 1e9, 100.0) == pytest.approx(23.2377, abs=1e-4)
    # four times the rows: a quarter of the ceiling for the same bytes
    assert bench.compute_ceiling_gbs(SMOLLM2, 64, 1e9, 100.0) == pytest.approx(23.2377 / 4, abs=1e-4)


def test_target_lengths_are_the_seeded_log_normal_cut():
    bench = _bench()
    t = bench.target_lengths(256, 64.0, 1.0, 512, seed=0)
    expected = np.clip(np.rint(np.random.default_rng(0).lognormal(np.log(64.0), 1.0, 256)), 1, 512)
    np.testing.assert_array_equal(t, expected)
    assert t.dtype == np.int64 and t.min() >= 1 and t.max() == 512  # a draw above 512 was cut
    big = bench.target_lengths(200_000, 64.0, 1.0, 10**9, seed=1)
    assert abs(np.median(big) - 64) <= 1
    assert abs(np.std(np.log(big)) - 1.0) < 0.01
    np.testing.assert_array_equal(bench.target_lengths(5, 64.0, 0.0, 512), [64] * 5)


def test_call_stats_cumulative_or_per_call_counters():
    bench = _bench()
    warm = {"decode_steps": 2, "decode_seconds": 5.0, "decode_tokens": 20, "live_kv_tokens_read": 900}
    call = {"decode_steps": 127, "decode_seconds": 3.0, "decode_tokens": 1270, "live_kv_tokens_read": 90000}
    cumulative = {k: warm[k] + call[k] for k in call}
    # 10 requests x 128 tokens: between 1270 and 1280 of them decoded
    assert bench.call_stats(warm, cumulative, (1270, 1280)) == call
    assert bench.call_stats(warm, call, (1270, 1280)) == call  # counters restarted with the call
    with pytest.raises(RuntimeError, match="decode_tokens 20 -> 500"):
        bench.call_stats(warm, dict(call, decode_tokens=500), (1270, 1280))


def test_smoke_preset_runs_and_ends_with_the_summary_line(tmp_path):
    out = tmp_path / "rollout_engine.json"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--skip-transformers", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    result = json.loads(out.read_text())
    assert result["last_line"] == last
    kvb = 2 * 2 * 2 * 16 * 4  # KV bytes per token of the tiny model: 2 layers, 2 KV heads, head_dim 16, float32

    for name, w in result["workloads"].items():
        targets = w["targets"]
        assert len(targets) == 16 and w["useful_tokens"] == sum(targets)
        static = w["sides"]["static"]
        # batches of 8 in request order, each row run to its batch's longest target
        maxima = [max(targets[:8]), max(targets[8:])]
        assert static["batch_new_tokens"] == maxima
        assert static["generated_tokens"] == 8 * sum(maxima)
        assert static["peak_kv_bytes"] == kvb * max(
            8 * (bucket_length(width, 16) + n) for width, n in zip(static["batch_prompt_widths"], maxima))
        assert static["useful_tokens_per_s"] == pytest.approx(sum(targets) / static["seconds"])
        assert not static["compiled_in_call"]  # every program compiled ahead of the timed calls
        assert "transformers" not in w["sides"]
    assert result["workloads"]["uniform"]["targets"] == [8] * 16
    assert max(result["workloads"]["heavy-tailed"]["targets"]) <= 8
    assert result["bandwidth_gbs"]["read"] > 0

    match = LAST_LINE.fullmatch(last)
    assert match, last
    heavy, uniform, decode = float(match[1]), float(match[2]), int(match[3])
    for name, ratio in (("heavy-tailed", heavy), ("uniform", uniform)):
        sides = result["workloads"][name]["sides"]
        engine = sides["engine"]
        assert engine["generated_tokens"] == engine["useful_tokens"] == sum(result["workloads"][name]["targets"])
        assert ratio == pytest.approx(engine["useful_tokens_per_s"] / sides["static"]["useful_tokens_per_s"],
                                      abs=0.005)
        # whole pages, within the pool: 8 slots x pages of the longest prompt + target, + the null page
        assert 0 < engine["peak_pages"] < engine["num_pages"]
        assert engine["peak_kv_bytes"] == engine["peak_pages"] * 16 * kvb
    rows = result["decode"]
    assert [r["slots"] for r in rows] == [4, 8]
    assert decode == round(100 * min(r["fraction_of_read_bandwidth"] for r in rows))
    for r in rows:
        assert r["call_stats"]["decode_tokens"] >= r["slots"] * 15  # 16 tokens each, the first from the prefill
        # 2 layers of q and o (64 x 64), k and v (64 x 32), gate, up and down (64 x 128); the tied head once
        assert r["weight_bytes"] == 4 * (2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 259 * 64)
        # the ceiling from the run's best matmul rate: the step's FLOPs at that rate, the same bytes
        best = max(result["matmul_gflops"].values())
        flops = 2 * r["slots"] * r["weight_bytes"] / 4
        assert r["compute_ceiling_gbs"] == pytest.approx((r["weight_bytes"] + r["kv_bytes"]) * best / flops)
        assert r["compute_ceiling_fraction"] == pytest.approx(
            min(r["compute_ceiling_gbs"] / result["bandwidth_gbs"]["read"], 1.0))

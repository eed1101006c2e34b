"""``rljax plan``: compile a run for a target from config.json shapes, report memory per chip, refuse what does not fit.

The default tests plan on the CPU mesh (8 simulated devices, in a subprocess: the device count is
fixed when JAX starts): the TPU extra (libtpu, 213 MB wheel, 680 MB installed) is not in the test
extra, because once installed every JAX process of the environment initialises it (stderr warnings
and a process lock file). With libtpu installed, ``test_plan_v5e_4`` plans the same run for a v5e-4;
with the cuda extra (JAX's CUDA plugin), ``test_plan_h100_8_compiles_without_a_gpu`` for 8 H100s.
"""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from rljax.tools.cli import main
from rljax.tools.plan import cuda_plugin_installed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every dimension divides the mesh (fsdp=4, tensor=2) except the single KV head (tensor=2): wk / wv
# fall back to replicating that dimension, which the plan must report.
TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 512, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}

CONFIG = """
model: {{name: {model}}}
data: {{max_prompt_length: 16}}
sampling: {{max_new_tokens: 16}}
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 2, kl_coef: 0.04}}
optim: {{learning_rate: 1.0e-5}}
rewards: {{correct: {{type: answer, weight: 1.0}}}}
mesh: {{fsdp: 4, tensor: 2}}
"""


@pytest.fixture
def plan_config(tmp_path):
    """A GRPO config whose model directory holds only config.json (no weights, no tokenizer)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    path = tmp_path / "grpo.yaml"
    path.write_text(CONFIG.format(model=model))
    return str(path)


def _per_chip_param_bytes() -> int:
    """float32 parameter bytes on one of the 8 devices, by hand from the sharding rules: embed [V, D]
    and lm_head [D, V] split over tensor (vocab) and fsdp (embed); wq, wo, MLP over fsdp × tensor;
    wk / wv [L, D, 1, hd] over fsdp only (1 KV head on tensor=2); norms whole."""
    L, D, H, hd, F, V = 2, 64, 4, 16, 128, 256
    split8 = 2 * V * D + L * (2 * D * H * hd + 3 * D * F)
    split4 = L * 2 * D * hd
    whole = 2 * L * D + D
    return 4 * (split8 // 8 + split4 // 4 + whole)


def _run_cli(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "rljax", "plan", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path)


def test_plan_cpu_mesh_reports_bytes_per_chip_and_refuses_what_does_not_fit(plan_config, tmp_path):
    report_path = tmp_path / "plan.json"
    # 0.1 MiB per chip: not even the update's arguments (parameters and AdamW moments: 160 KiB) fit
    # the static sampler, whose argument bytes are counted below (the engine's programs: the next test)
    proc = _run_cli([plan_config, "--target", "cpu-8", "--memory-gib", str(0.1 / 1024), "--json", str(report_path),
                     "sampling.engine=static"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout
    assert "DOES NOT FIT" in out
    for advice in ("mesh.fsdp", "model.remat=block", "model.logits_chunk", "algorithm.micro_batch_size"):
        assert advice in out, (advice, out)
    report = json.loads(report_path.read_text())
    assert report["num_devices"] == 8 and report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert not report["fits"]
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == {"update", "scoring", "sampler"}

    params = _per_chip_param_bytes()
    # one device's share of a [2 rows (8 over data × fsdp = 4), 16 tokens] int32 / float32 array
    field = 2 * 16 * 4
    # XLA drops the arguments a program never reads (jit's keep_unused=False). The update reads prompt
    # ids and mask, completion ids and mask (the forward attends to every completion token; the loss
    # mask leaves out a multi-turn trajectory's environment tokens), loss mask, old and reference
    # log-probs, advantages ([R, N] each; not scores, row_mask, finished, nor the permutation key
    # with one mini-batch), the parameters, AdamW's two moments (sharded like them) and its two int32
    # step counts.
    assert programs["update"]["argument_bytes"] == 3 * params + 8 * field + 2 * 4
    assert programs["update"]["alias_bytes"] == 3 * params + 2 * 4  # donated: updated in place
    assert programs["update"]["other_argument_bytes"] == 8 * field  # the batch
    # out: the new parameters, moments and counts, sharded as they came in, and the step's metrics
    assert 3 * params + 2 * 4 <= programs["update"]["output_bytes"] < 3 * params + 4096
    # held through every program: policy, AdamW state, and (full fine-tuning, KL on) the reference copy
    for p in programs.values():
        assert p["resident_bytes"] == 4 * params + 2 * 4
    # scoring: the parameters, prompt ids and mask, completion ids and mask
    assert programs["scoring"]["argument_bytes"] == params + 4 * field
    # the sampler: the parameters, prompt ids and mask (8 rows, bucketed), the sampling key (2 × uint32)
    assert programs["sampler"]["argument_bytes"] == params + 2 * field + 8
    # the FSDP all-gathers of the parameters and the gradient reductions are in the update
    assert programs["update"]["collectives"].get("all-gather", 0) > 0
    assert programs["update"]["collectives"].get("all-reduce", 0) + \
        programs["update"]["collectives"].get("reduce-scatter", 0) > 0
    # XLA's FLOP count of the update (no scan: layers unrolled) within 10% of 6·N·tokens + attention
    update = programs["update"]
    assert update["flops"] == pytest.approx(update["analytic_flops"] / 8, rel=0.1)
    assert sorted(report["replicated"]) == ["layers.wk: kv_heads=1 not divisible by tensor=2",
                                            "layers.wv: kv_heads=1 not divisible by tensor=2"]


def test_plan_compiles_the_engines_prefill_and_decode_and_counts_kv_pages(plan_config, tmp_path):
    report_path = tmp_path / "plan.json"
    proc = _run_cli([plan_config, "--target", "cpu-8", "--json", str(report_path), "sampling.page_size=4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == {"update", "scoring", "engine prefill", "engine decode"}
    decode = programs["engine decode"]
    # the page pools (keys and values of every layer) are donated: updated in place
    assert decode["alias_bytes"] > 0 and decode["decode_steps"] > 0
    assert "KV pages per chip:" in decode["note"] and "of 4 tokens" in decode["note"]
    assert "KV pages per chip:" in proc.stdout
    # by hand: a page holds its 4 tokens' keys and values in both layers, 1 KV head (replicated: it
    # does not divide tensor=2) x head_dim 16, float32. The pages fill the chip's memory left beside
    # the run's state, the decode step's temporaries and its decode weights (within its arguments).
    # (Counting one layer's keys alone, the plan once reported 2 x layers = 4 times as many.)
    fit = int(re.search(r"KV pages per chip: ([\d,]+) of 4 tokens", decode["note"])[1].replace(",", ""))
    page = 2 * 2 * 1 * 16 * 4 * 4
    free = report["memory_bytes"] - decode["resident_bytes"] - decode["temp_bytes"]
    assert (free - decode["argument_bytes"]) // page <= fit <= free // page


def test_a_disaggregated_plan_compiles_generation_on_the_rollout_devices_and_the_update_on_the_rest(plan_config,
                                                                                                     tmp_path):
    report_path = tmp_path / "plan.json"
    proc = _run_cli([plan_config, "--target", "cpu-8", "--json", str(report_path), "mesh.rollout_devices=4",
                     "mesh.fsdp=2", "train.max_staleness=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["rollout_devices"] == 4 and report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}  # 4 train
    programs = {p["name"]: p for p in report["programs"]}
    assert {n: (p["devices"], p["generation"]) for n, p in programs.items()} == {
        "update": (4, False), "scoring": (4, False), "engine prefill": (4, True), "engine decode": (4, True)}
    # by hand: 102,720 float32 parameters (embed, head, 2 layers of wq wo wk wv and MLP, norms), all trainable,
    # resharded after each update; on the rollout mesh (fsdp=4) every matrix is split 4 ways, the norms whole
    matrices, norms = 2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 128), 2 * 2 * 64 + 64
    assert report["trainable_params"] == matrices + norms and report["weight_sync_bytes"] == 4 * (matrices + norms)
    assert programs["engine decode"]["resident_bytes"] == 4 * (matrices // 4 + norms)
    assert "disaggregated (mesh.rollout_devices=4)" in proc.stdout and "one step, overlapped" in proc.stdout
    assert "engine decode (rollout devices)" in proc.stdout
    # every device generating leaves none to train: refused naming the key, as the trainer refuses it
    bad = _run_cli([plan_config, "--target", "cpu-8", "mesh.rollout_devices=8", "train.max_staleness=1"], tmp_path)
    assert bad.returncode == 2
    assert "mesh.rollout_devices: 8 rollout device(s) leave no training device: there are 8 device(s)" in bad.stderr


def test_plan_errors_name_the_setting(plan_config, capsys):
    assert main(["plan", plan_config, "--target", "v9-4"]) == 2
    err = capsys.readouterr().err
    assert "'v9-4' is not a known target" in err and "v5e-16" in err and "cpu-N" in err
    assert "h100-8" in err and "h100-16" in err and "a100-8" in err
    # the test process has one CPU device: a 2 × 4 × 2 mesh needs 16
    assert main(["plan", plan_config, "--target", "cpu", "mesh.data=2"]) == 2
    err = capsys.readouterr().err
    assert "mesh: mesh {'data': 2, 'fsdp': 4, 'tensor': 2} needs 16 devices" in err and "cpu has 1 device(s)" in err
    if importlib.util.find_spec("libtpu") is None:
        assert main(["plan", plan_config, "--target", "v5e-4"]) == 2
        err = capsys.readouterr().err
        assert "libtpu, which is not installed" in err and "pip install -e '.[tpu]'" in err
    if not cuda_plugin_installed():
        assert main(["plan", plan_config, "--target", "h100-8"]) == 2
        err = capsys.readouterr().err
        assert "'h100-8' compiles with JAX's CUDA plugin, which is not installed" in err
        assert "pip install -e '.[cuda]'" in err


def test_gpu_targets_nodes_of_eight_and_the_allocators_share_of_memory(monkeypatch):
    from rljax.tools.plan import get_target, usable_memory

    h100 = get_target("h100-16")
    assert (h100.platform, h100.num_devices, h100.topology) == ("cuda", 16, "1x2x8")  # 2 nodes × 8 GPUs
    assert get_target("a100-4").topology == "1x1x4"
    # XLA's H100 SXM description: 84,942,979,072 bytes; JAX's allocator takes 75 % unless told otherwise
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert usable_memory(h100) == 63707234304
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert usable_memory(h100) == 76448681164
    assert usable_memory(get_target("v5e-4")) == 16 * 2 ** 30  # a TPU's whole HBM
    from rljax.errors import UserError

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(UserError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='1.5' must be in"):
        usable_memory(h100)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "accel", "*.yaml"))))
def test_accelerator_configs_parse_and_their_models_need_only_config_json(path):
    from rljax.config import load_config
    from rljax.tools.plan import model_config_for
    from rljax.run_config import RunConfig

    cfg = load_config(RunConfig, path)
    model_dir = os.path.join(REPO, cfg.model.name)
    assert os.listdir(model_dir) == ["config.json"]  # nothing else: no weights, no tokenizer
    assert model_config_for(model_dir).num_layers >= 28


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the tpu extra (libtpu)")
def test_plan_v5e_4(plan_config, tmp_path):
    report_path = tmp_path / "plan.json"
    proc = _run_cli([plan_config, "--target", "v5e-4", "mesh.tensor=1", "--json", str(report_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["fits"] and report["num_devices"] == 4 and report["chip"]["memory_bytes"] == 16 * 2 ** 30
    assert "FITS" in proc.stdout


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs the cuda extra (JAX's CUDA plugin)")
def test_plan_h100_8_compiles_without_a_gpu(plan_config, tmp_path):
    report_path = tmp_path / "plan.json"
    proc = _run_cli([plan_config, "--target", "h100-8", "--json", str(report_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["fits"] and report["num_devices"] == 8 and report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert report["memory_bytes"] == int(84942979072 * 0.75)
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == {"update", "scoring", "engine prefill", "engine decode"}
    # the same per-device shards as on the CPU mesh: parameters, AdamW moments and steps, the batch
    assert programs["update"]["argument_bytes"] == 3 * _per_chip_param_bytes() + 8 * 2 * 16 * 4 + 2 * 4
    assert programs["update"]["collectives"].get("all-gather", 0) > 0
    update = programs["update"]
    # the new parameters and moments come back sharded as they went in (rljax.sharding.constrain_state;
    # unconstrained, the CUDA partitioner returned them replicated: 8x the state on each GPU), plus the metrics
    assert 3 * _per_chip_param_bytes() <= update["output_bytes"] < 3 * _per_chip_param_bytes() + 4096
    assert update["flops"] is None  # no cost analysis for GPU targets: the analytic count stands
    # ... and the roofline's bytes: each argument and output moved once, each temporary twice (a lower bound)
    moved = update["argument_bytes"] + update["output_bytes"] + 2 * update["temp_bytes"]
    compute = update["analytic_flops"] / 8 / report["chip"]["peak_flops"]
    assert update["time_s"] == pytest.approx(max(compute, moved / report["chip"]["memory_bandwidth"]), rel=1e-9)
    assert "no cost analysis for this target" in proc.stdout and "FITS" in proc.stdout


@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the tpu extra (libtpu)")
def test_plan_smallest_real_config_fits(tmp_path):
    proc = _run_cli([os.path.join(REPO, "configs", "accel", "grpo_qwen2.5-1.5b_v5e-16.yaml"), "--target", "v5e-16"],
                    REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FITS" in proc.stdout


def test_llama3_config_with_several_eos_ids_stays_hashable():
    # the model's graph (holding its config) is a static argument of every jitted step
    from rljax.models.config import ModelConfig
    from rljax.tools.plan import model_config_for

    config = model_config_for(os.path.join(REPO, "configs", "models", "llama-3.1-8b-instruct"))
    assert config.eos_token_id == (128001, 128008, 128009) and config.eos_token_ids == (128001, 128008, 128009)
    hash(config)
    assert config.to_hf_dict()["eos_token_id"] == [128001, 128008, 128009]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_count_collectives_counts_async_pairs_once():
    from rljax.tools.plan import count_collectives

    hlo = """
  %all-gather-start.1 = (f32[4], f32[16]) all-gather-start(f32[4] %p), dimensions={0}
  %all-gather-done.1 = f32[16] all-gather-done((f32[4], f32[16]) %all-gather-start.1)
  %all-reduce.2 = f32[8] all-reduce(f32[8] %x), replica_groups={}, to_apply=%add
  %collective-permute.3 = f32[8] collective-permute(f32[8] %y), source_target_pairs={{0,1}}
  %fusion.all-reduce-like = f32[8] fusion(f32[16] %all-gather-done.1), calls=%fused
"""
    assert count_collectives(hlo) == {"all-gather": 1, "all-reduce": 1, "collective-permute": 1}


def test_analytic_flops_by_hand():
    from rljax.models.config import ModelConfig
    from rljax.tools.plan import analytic_flops

    c = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=1,
                    head_dim=16)
    # per layer: q 64·64 + k, v 2·64·16 + o 64·64 + MLP 3·64·128 = 34816; LM head 64·256
    matmul = 2 * 34816 + 64 * 256
    rows, T = 3, 10
    attention = 4 * 2 * 4 * 16 * T * T * rows  # QKᵀ and AV, 2 FLOPs per multiply-add, per layer and row
    assert analytic_flops(c, T, rows, passes=1.0) == 2 * matmul * rows * T + attention
    assert analytic_flops(c, T, rows, passes=3.0) == 3 * (2 * matmul * rows * T + attention)
    assert analytic_flops(c, T, rows, passes=1.0, with_head=False) == 2 * (matmul - 64 * 256) * rows * T + attention


def test_a_matmul_xla_cannot_tile_without_a_gpu_is_compiled_with_cublas_and_said_so():
    """XLA's GPU compiler, autotuning with no GPU, can fail to tile a Triton matmul ("Couldn't find output
    tile sizes", seen on online_vs_offline --full for h100-1); the plan compiles that program again with
    Triton matmuls off and says so. Any other compile error is not caught."""
    from rljax.tools.plan import programs as plan

    real = jax.jit(lambda x: x @ x.T)
    x = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    options = []

    class Lowered:
        def __init__(self, lowered, error):
            self.lowered, self.error = lowered, error

        def compile(self, compiler_options=None):
            options.append(compiler_options)
            if compiler_options is None:
                raise RuntimeError(self.error)
            return self.lowered.compile()  # the CPU compiler has no such option: compile as is

    class Jitted:
        def __init__(self, error):
            self.error = error

        def lower(self, *args, **kwargs):
            return Lowered(real.lower(*args, **kwargs), self.error)

    untileable = "INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot_general.530 = f32[55296,256]"
    report = plan._compile("update", "x @ x.T", Jitted(untileable), (x,), {}, 0.0)
    assert options == [None, {"xla_gpu_enable_triton_gemm": False}]
    assert report.note.startswith("update: compiled with xla_gpu_enable_triton_gemm=false")
    assert report.output_bytes == 4 * 4 * 4 and not report.oom
    options.clear()
    with pytest.raises(RuntimeError, match="something else"):
        plan._compile("update", "x @ x.T", Jitted("INTERNAL: something else"), (x,), {}, 0.0)
    assert options == [None]

"""The accelerator check: what one GPU measures of rljax that ``rljax plan`` only predicts.

Question: does rljax compute the right numbers on a GPU, how fast, and how far off is the plan?

One command, under 8 minutes on one H100 (``experiments/accel/run_on_gpu.sh`` wraps it there):

    python experiments/accel/gpu_check.py                  # on the GPU machine
    python experiments/accel/gpu_check.py --cpu --smoke    # every part on the CPU, tiny shapes, < 1 min

Parts (each guarded: a failure is written as FAILED with its error and the next part runs; the
results file is rewritten after every part, so a timeout still leaves what finished):

1. Correctness. (a) A tiny float32 model's logits on the default device against the same weights on
   the CPU (max |diff| <= 1e-4). (b) The sampler's per-token log-probs against the trainer's forward
   (``rljax.logprobs.completion_logprobs``) for the same tokens on the device: float32 <= 1e-5;
   bfloat16 reported, not asserted. Both are asserted at ``jax.default_matmul_precision("highest")``
   (a GPU's default float32 matmul may use TF32) and also reported at the default precision.
   (c) A short GRPO run on the arithmetic policy the reproductions pretrain
   (``paper_repro/_arith_policy.py``): the mean reward of the last steps against the first.
2. Speed, random weights of ``configs/models/qwen2.5-1.5b-instruct`` (and a 0.5B shape if time is
   left), bfloat16 parameters with a float32 master copy (``optim.master_dtype``): the update step
   (``rljax.training.online.update_epochs``) and the scoring pass (``score_logprobs``) on the shapes of
   :data:`SPEED_OVERRIDES`, MFU = analytic FLOPs (``rljax.tools.plan.analytic_flops``: 6·N·tokens + attention
   for the update, 2·N·tokens + attention for scoring; remat's recompute not counted) / median step
   time / the chip's dense bfloat16 peak (H100 SXM and H200: 989 TFLOP/s); generation tokens/s of
   ``rljax.sampling.generate`` at 64 and 256 concurrent sequences against transformers ``generate``
   (torch, same config, random weights, bfloat16) on the same GPU.
3. The plan checked: ``rljax plan`` of the same run config for ``h100-1`` / ``h200-1`` (by the device
   name; ``cpu`` with ``--cpu``) beside the measured peak memory
   (``memory_stats()['peak_bytes_in_use']`` after the update) and the measured step times.
4. Results: ``experiments/results/gpu_check_<gpu>.md`` (``--out`` to change), with the JAX, jaxlib,
   plugin, CUDA and driver versions (``jax.print_environment_info``, ``nvidia-smi``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_1_5B = "configs/models/qwen2.5-1.5b-instruct"
RUN_CONFIG = "configs/accel/grpo_qwen2.5-1.5b_h100-8.yaml"
# one GPU: 64 rollouts of 256 + 512 tokens (the node config's shapes, fewer rows and tokens so the
# whole check fits its minutes), mixed precision
SPEED_OVERRIDES = ["mesh.fsdp=1", "algorithm.prompts_per_step=8", "algorithm.micro_batch_size=64",
                   "sampling.max_new_tokens=512", "optim.master_dtype=float32", "train.run_dir=runs/accel/speed"]
# the 0.5B shape (Qwen2.5-0.5B-Instruct's published config.json values), written beside the run
QWEN_0_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
             "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
             "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 151936,
             "bos_token_id": 151643, "eos_token_id": 151645, "max_position_embeddings": 32768,
             "torch_dtype": "bfloat16"}
PEAK_BF16 = {"h100": 989.4e12, "h200": 989.4e12}  # dense bfloat16 FLOP/s per chip (SXM)
GEN_ROWS, GEN_PROMPT, GEN_NEW = (64, 256), 128, 256


def plan_api():
    """The planner's public entry points, as ``rljax plan`` (rljax/tools/cli.py) imports them: the one
    place to change if the planner moves."""
    from rljax.tools.plan import format_report, plan_run

    return plan_run, format_report


# ----------------------------------------------------------------------------------------- report
class Report:
    """Sections of the results file, rewritten in full after each part."""

    def __init__(self, path: str, title: str):
        self.path, self.title, self.sections = path, title, {}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def set(self, name: str, text: str) -> None:
        self.sections[name] = text.rstrip() + "\n"
        with open(self.path + ".tmp", "w") as f:
            f.write(f"# {self.title}\n\n" + "\n".join(f"## {k}\n\n{v}" for k, v in self.sections.items()))
        os.replace(self.path + ".tmp", self.path)


def table(header: list[str], rows: list[list]) -> str:
    def cell(x):
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_part(report: Report, name: str, fn, log, *, deadline: float, needs_s: float) -> None:
    """``fn()`` returns the section's markdown; an exception becomes a FAILED section."""
    left = deadline - time.perf_counter()
    if left < needs_s:
        report.set(name, f"SKIPPED: {left:.0f} s of the time budget left, the part needs about {needs_s:.0f} s\n")
        log(f"[{name}] skipped ({left:.0f} s left)")
        return
    log(f"[{name}] start")
    t0 = time.perf_counter()
    try:
        text = fn()
        report.set(name, text + f"\n({time.perf_counter() - t0:.1f} s)\n")
        log(f"[{name}] done in {time.perf_counter() - t0:.1f} s")
    except Exception as err:  # one part's failure must not stop the others
        tb = traceback.format_exc(limit=6)
        report.set(name, f"FAILED: {type(err).__name__}: {str(err)[:800]}\n\n```\n{tb[-3000:]}```\n")
        log(f"[{name}] FAILED: {type(err).__name__}: {str(err)[:300]}")


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def timed(fn, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` (which blocks until its result is ready)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------------------ environment
def gpu_name(device) -> str:
    """``h100`` / ``h200`` / ``a100`` from the device kind, ``cpu`` on the CPU, else the kind slugged."""
    kind = device.device_kind.lower()
    if device.platform == "cpu":
        return "cpu"
    for chip in ("h200", "h100", "a100"):
        if chip in kind:
            return chip
    return "".join(c if c.isalnum() else "-" for c in kind).strip("-") or "gpu"


def part_environment(device) -> str:
    import jax

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            jax.print_environment_info()
        except Exception as err:  # noqa: BLE001 (older jax or no nvidia-smi)
            print(f"jax.print_environment_info failed: {err}")
    smi = ""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = "(nvidia-smi not found)"
    versions = []
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "transformers", "torch",
                 "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt"):
        try:
            from importlib.metadata import version

            versions.append([name, version(name)])
        except Exception:  # noqa: BLE001 (not installed)
            pass
    rows = [["device", f"{device.platform}: {device.device_kind} (x{len(jax.devices())})"],
            ["python", platform.python_version()], *versions]
    return (table(["what", "version"], rows) + "\n```\n" + buf.getvalue().strip() + "\n```\n\n"
            + "nvidia-smi:\n\n```\n" + smi + "\n```\n")


# ------------------------------------------------------------------------------------ correctness
def _tiny_batch(rng, rows: int, width: int, vocab: int):
    import numpy as np

    ids = np.zeros((rows, width), np.int32)
    mask = np.zeros_like(ids)
    for i in range(rows):
        n = int(rng.integers(width // 2, width + 1))
        ids[i, width - n:] = rng.integers(3, vocab, n)
        mask[i, width - n:] = 1
    return ids, mask


def precisions() -> tuple[str, ...]:
    """Matmul precisions to run at: on a GPU "highest" (asserted) and "default" (reported: TF32 may
    enter); on the CPU, whose float32 default is already full precision, "highest" alone."""
    import jax

    return ("highest",) if jax.devices()[0].platform == "cpu" else ("highest", "default")


def part_logits() -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rljax.models.tiny import BYTE_VOCAB_SIZE, tiny_config
    from rljax.models.transformer import init_model

    config = tiny_config(BYTE_VOCAB_SIZE, layers=2, hidden=64, heads=4, kv_heads=2)
    graphdef, state = nnx.split(init_model(config, seed=0))
    ids, mask = _tiny_batch(np.random.default_rng(0), 4, 24, BYTE_VOCAB_SIZE)

    @jax.jit
    def logits(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    cpu = jax.devices("cpu")[0]
    dev = jax.devices()[0]
    rows, ok = [], True
    for precision in precisions():
        ctx = jax.default_matmul_precision(precision) if precision != "default" else contextlib.nullcontext()
        with ctx:
            ref = np.asarray(logits(*jax.device_put((state, jnp.asarray(ids), jnp.asarray(mask)), cpu)))
            got = np.asarray(logits(*jax.device_put((state, jnp.asarray(ids), jnp.asarray(mask)), dev)))
        valid = mask.astype(bool)
        diff = float(np.max(np.abs(got - ref)[valid]))
        passed = diff <= 1e-4
        if precision == "highest":
            ok = passed
        rows.append([precision, diff, 1e-4, ("PASS" if passed else "FAIL") if precision == "highest" else
                     ("within" if passed else "over") + " (reported)"])
    if not ok:
        raise AssertionError(f"device logits differ from the CPU's by {rows[0][1]:.3g} > 1e-4 (float32, highest)")
    return (f"Tiny float32 model ({config.num_layers} layers, hidden {config.hidden_size}, vocab "
            f"{config.vocab_size}), 4 left-padded rows of up to 24 tokens: logits on {dev.device_kind} vs CPU, "
            "max |diff| over real tokens.\n\n" + table(["matmul precision", "max abs diff", "tolerance", "result"], rows))


def part_logprobs() -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rljax.logprobs import completion_logprobs
    from rljax.models.tiny import BYTE_VOCAB_SIZE, tiny_config
    from rljax.models.transformer import init_model
    from rljax.sampling import SamplingConfig, generate

    config = tiny_config(BYTE_VOCAB_SIZE, layers=2, hidden=64, heads=4, kv_heads=2)
    ids, mask = _tiny_batch(np.random.default_rng(1), 8, 16, BYTE_VOCAB_SIZE)
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    rows, failures = [], []
    for dtype_name, dtype, tol in (("float32", jnp.float32, 1e-5), ("bfloat16", jnp.bfloat16, None)):
        model = init_model(config, seed=0, dtype=dtype, param_dtype=dtype)
        for precision in precisions():
            ctx = jax.default_matmul_precision(precision) if precision != "default" else contextlib.nullcontext()
            with ctx:
                out = generate(model, ids, mask, jax.random.key(3), sampling)
                train = completion_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), out.tokens, out.mask,
                                            temperature=sampling.temperature)["logprobs"]
            m = np.asarray(out.mask).astype(bool)
            diff = float(np.max(np.abs(np.asarray(out.logprobs) - np.asarray(train))[m]))
            asserted = tol is not None and precision == "highest"
            verdict = ("PASS" if diff <= tol else "FAIL") if asserted else "reported"
            if asserted and diff > tol:
                failures.append(f"{dtype_name}: {diff:.3g} > {tol}")
            rows.append([dtype_name, precision, diff, tol if tol is not None else "-", verdict])
    if failures:
        raise AssertionError("sampler vs trainer log-probs: " + "; ".join(failures) + "\n\n"
                             + table(["dtype", "matmul precision", "max abs diff", "tolerance", "result"], rows))
    return (f"Sampler (`generate`, KV cache) vs trainer (`completion_logprobs`, one forward) log-probs of the "
            f"same {sampling.max_new_tokens} sampled tokens x 8 rows, on {jax.devices()[0].device_kind}.\n\n"
            + table(["dtype", "matmul precision", "max abs diff", "tolerance", "result"], rows))


def part_grpo(smoke: bool, cache_root: str, run_root: str, log, *, max_rl_s: float) -> str:
    sys.path.insert(0, ROOT)
    from paper_repro import _arith_policy as ap
    from rljax.training import OnlineTrainer

    spec = ap.PolicySpec.smoke() if smoke else ap.PolicySpec()
    steps, prompts, group, lr = (3, 2, 4, 1e-4) if smoke else (120, 16, 8, 2e-4)
    t0 = time.perf_counter()
    model_dir, stats = ap.pretrain_policy(spec, cache_root, log=log)
    sft_s = time.perf_counter() - t0
    cfg = ap.rl_config(spec, model_dir, os.path.dirname(model_dir), os.path.join(run_root, "grpo"), [
        f"train.steps={steps}", f"algorithm.prompts_per_step={prompts}", f"algorithm.group_size={group}",
        f"optim.learning_rate={lr}", "algorithm.reduction=token_mean", "train.seed=0"])
    # ap.run_rl's loop, stopped after max_rl_s so the check keeps to its minutes
    trainer = OnlineTrainer(cfg, overwrite=True)
    rows, t0 = [], time.perf_counter()
    for step in range(steps):
        rows.append(ap.step_row(trainer, trainer.step_once()))
        if step % 10 == 0:
            log(f"  grpo step {step + 1}: reward {rows[-1]['reward']:.3f}")
        if time.perf_counter() - t0 > max_rl_s:
            break
    rl_s = time.perf_counter() - t0
    window = max(1, min(20, len(rows) // 4))
    first, last = ap.first_window(rows, "reward", window), ap.final_window(rows, "reward", window)
    verdict = "not judged (smoke: too few steps)" if smoke else ("PASS: reward went up" if last > first else
                                                                 "FAIL: reward did not go up")
    trained_s = stats.get("sft_seconds", sft_s)  # the time it took when it was trained, cached or not
    cached = f" (cached, found in {sft_s:.0f} s)" if trained_s > sft_s + 1 else ""
    text = (f"GRPO on the arithmetic policy (`paper_repro/_arith_policy.py`, {spec.layers} layer(s) x {spec.hidden}, "
            f"pretrained by {spec.sft_steps} SFT steps in {trained_s:.0f} s{cached}: accuracy {stats['accuracy']:.3f} "
            f"at temperature 1), {len(rows)} of {steps} steps (stopped after {max_rl_s:.0f} s) of {prompts} prompts x "
            f"{group}, lr {lr}.\n\n"
            + table(["first steps' reward", "last steps' reward", "window (steps)", "s per step", "RL seconds"],
                    [[first, last, window, rl_s / max(len(rows), 1), rl_s]]) + f"\n{verdict}\n")
    if not smoke and not last > first:
        raise AssertionError(f"reward did not go up: {first:.3f} -> {last:.3f}\n\n{text}")
    return text


# ------------------------------------------------------------------------------------------ speed
class SpeedRun:
    """A run config's update and scoring programs on concrete random state, as ``rljax plan`` compiles them."""

    def __init__(self, cfg):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from flax import nnx

        from rljax.algorithms import get as get_algorithm
        from rljax.batches import RolloutBatch
        from rljax.buckets import bucket_length
        from rljax.models import dtype_from_name
        from rljax.models.transformer import init_model
        from rljax.rollout import packing_group
        from rljax.sharding import make_mesh
        from rljax.update import optimizer_for

        plan_run, _ = plan_api()
        del plan_run  # imported for its module: model_config_for lives beside it
        from rljax.tools.plan import model_config_for

        self.cfg, self.jax = cfg, jax
        self.config = model_config_for(cfg.model.name)
        a, m = cfg.algorithm, cfg.model
        self.algo = get_algorithm(a.name)
        self.mesh = make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
        self.rules = cfg.mesh.rule_table()
        dtype = dtype_from_name(m.dtype)
        model = init_model(self.config, seed=0, dtype=dtype, param_dtype=dtype_from_name(m.storage_dtype),
                           scan_layers=m.scan_layers)
        model.logits_chunk, model.remat, model.attention_chunk = m.logits_chunk, m.remat, m.attention_chunk
        self.graphdef, self.params, self.frozen = nnx.split(model, nnx.Param, ...)
        self.optimizer = optimizer_for(cfg.optim, cfg.train.steps * a.num_iterations * a.mini_batches)
        self.opt_state = self.optimizer.init(self.params)
        R, G = a.prompts_per_step * a.group_size, a.group_size
        P, N = bucket_length(cfg.data.max_prompt_length, 16), cfg.sampling.max_new_tokens
        self.R, self.P, self.N = R, P, N
        rng = np.random.default_rng(0)
        prompt = np.repeat(rng.integers(3, self.config.vocab_size, (R // G, P)), G, axis=0).astype(np.int32)
        completion = rng.integers(3, self.config.vocab_size, (R, N)).astype(np.int32)
        ones_p, ones_n = np.ones((R, P), np.int32), np.ones((R, N), np.int32)
        base = RolloutBatch(
            prompt_ids=jnp.asarray(prompt), prompt_mask=jnp.asarray(ones_p), completion_ids=jnp.asarray(completion),
            completion_mask=jnp.asarray(ones_n), loss_mask=jnp.asarray(ones_n),
            old_logprobs=jnp.asarray(rng.normal(-3.0, 1.0, (R, N)), jnp.float32),
            scores=jnp.asarray(rng.integers(0, 2, R), jnp.float32), row_mask=jnp.ones((R,), bool),
            finished=jnp.ones((R,), bool),
            ref_logprobs=jnp.asarray(rng.normal(-3.0, 1.0, (R, N)), jnp.float32)
            if self.algo.needs_reference(a) else None,
            prompt_group=packing_group(R, G, a.num_micro))
        batch = self.algo.advantages_and_state(base, a, self.algo.start_state(a))[0]
        # committed to the device, as the update's outputs are: one compile, not a second at call two
        device = jax.devices()[0]
        self.params, self.frozen, self.opt_state, self.batch, self.key = jax.device_put(
            (self.params, self.frozen, self.opt_state, batch, jax.random.key(0)), device)
        # the trainer keeps a copy of a full fine-tune's starting weights as the reference (and the
        # plan counts it in the resident state): hold one too, so the peak memory compares like for like
        needs_copy = self.algo.needs_reference(a) and not m.lora_rank
        self.reference = jax.tree.map(jnp.copy, self.params) if needs_copy else None

    def _scope(self):
        from rljax.sharding import use_mesh

        return use_mesh(self.mesh, self.rules)

    def update(self):
        from rljax.training.online import update_epochs

        a = self.cfg.algorithm
        with self._scope():
            self.params, self.opt_state, _, _, metrics = update_epochs(
                self.graphdef, self.params, self.frozen, self.opt_state, self.batch, self.key,
                optimizer=self.optimizer, algorithm=a.name, cfg=a, temperature=self.cfg.sampling.temperature,
                num_micro=a.num_micro, num_iterations=a.num_iterations, mini_batches=a.mini_batches)
        self.jax.block_until_ready((self.params, metrics))
        return metrics

    def score(self):
        from rljax.training.online import score_logprobs

        with self._scope():
            out = score_logprobs(self.graphdef, self.params, self.frozen, self.batch,
                                 temperature=self.cfg.sampling.temperature)
        return self.jax.block_until_ready(out)


def speed_config(model_name: str, smoke: bool):
    from rljax.config import load_config
    from rljax.run_config import RunConfig

    overrides = [*SPEED_OVERRIDES, f"model.name={model_name}"]
    if smoke:
        overrides += ["algorithm.prompts_per_step=2", "algorithm.group_size=4", "algorithm.micro_batch_size=8",
                      "data.max_prompt_length=16", "sampling.max_new_tokens=16", "model.logits_chunk=8"]
    return load_config(RunConfig, os.path.join(ROOT, RUN_CONFIG), overrides)


def peak_flops(device, smoke_peak: float | None) -> tuple[float, str]:
    chip = gpu_name(device)
    if chip in PEAK_BF16:
        return PEAK_BF16[chip], f"{chip.upper()} SXM dense bfloat16 peak"
    return smoke_peak, "this CPU's measured float32 matmul rate (a stand-in: the CPU has no bfloat16 peak)"


def cpu_matmul_peak() -> float:
    import jax
    import jax.numpy as jnp

    n = 512
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = min(timed(lambda: f(x).block_until_ready(), 5))
    return 2 * n ** 3 / best


def memory_peak(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (the CPU client has none)
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def part_speed(label: str, model_name: str, smoke: bool, results: dict, peak: float, peak_what: str,
               repeats: int) -> str:
    import jax

    from rljax.tools.plan import analytic_flops

    cfg = speed_config(model_name, smoke)
    run = SpeedRun(cfg)
    R, P, N, config = run.R, run.P, run.N, run.config
    t0 = time.perf_counter()
    run.update()  # compile + first call
    update_compile = time.perf_counter() - t0
    run.update()  # a second warm-up call
    update_s = median(timed(run.update, repeats))
    device = jax.devices()[0]
    peak_after_update = memory_peak(device)
    t0 = time.perf_counter()
    run.score()
    score_compile = time.perf_counter() - t0
    score_s = median(timed(run.score, repeats))
    a = cfg.algorithm
    update_flops = analytic_flops(config, P + N, R, passes=3.0 * a.num_iterations)
    score_flops = analytic_flops(config, P + N, R, passes=1.0)
    n_params = sum(x.size for x in jax.tree.leaves((run.params, run.frozen)))
    results[label] = dict(cfg=cfg, update_s=update_s, score_s=score_s, peak_bytes=peak_after_update,
                          update_flops=update_flops, score_flops=score_flops)
    rows = [["update (update_epochs)", f"[{R} rows, {P}+{N} tokens], {a.num_micro} micro-batch(es)", update_compile,
             update_s, update_flops / update_s / 1e12, 100 * update_flops / update_s / peak],
            ["scoring (score_logprobs)", f"[{R} rows, {P}+{N} tokens]", score_compile, score_s,
             score_flops / score_s / 1e12, 100 * score_flops / score_s / peak]]
    peak_text = "n/a (no memory_stats on this device)" if peak_after_update is None else \
        f"{peak_after_update / 2 ** 30:.2f} GiB"
    return (f"`{model_name}`, random weights, {n_params / 1e6:.2f} M parameters, model.dtype {cfg.model.dtype} "
            f"with a {cfg.optim.master_dtype} master copy, remat {cfg.model.remat}, logits_chunk "
            f"{cfg.model.logits_chunk}; median of {repeats} calls after the compile. MFU against {peak / 1e9:.4g} "
            f"GFLOP/s ({peak_what}); FLOPs analytic (6·N·tokens + attention for the update, 2·N·tokens + attention "
            f"for scoring; remat's recompute not counted).\n\n"
            + table(["program", "shapes", "compile + first call (s)", "step (s)", "TFLOP/s", "MFU %"], rows)
            + f"\nPeak device memory after the update (`peak_bytes_in_use`): {peak_text}\n")


def _hf_model(model_dir: str, device_str: str, dtype_name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    return model.to(device_str).eval()


def part_generation(model_name: str, smoke: bool, skip_transformers: bool, repeats: int) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rljax.models import dtype_from_name
    from rljax.models.transformer import init_model
    from rljax.tools.plan import model_config_for
    from rljax.sampling import SamplingConfig, generate

    config = model_config_for(model_name)
    dtype_name = "float32" if smoke else "bfloat16"
    dtype = dtype_from_name(dtype_name)
    model = init_model(config, seed=0, dtype=dtype, param_dtype=dtype, scan_layers=True)
    rows_list, P, N = ((4, 8), 8, 8) if smoke else (GEN_ROWS, GEN_PROMPT, GEN_NEW)
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, ignore_eos=True, pad_token_id=0)
    rng = np.random.default_rng(0)
    out_rows, notes = [], []
    hf, torch = None, None
    if not skip_transformers:
        try:
            import torch

            device_str = "cuda" if (jax.devices()[0].platform == "gpu" and torch.cuda.is_available()) else "cpu"
            hf = _hf_model(os.path.join(ROOT, model_name) if not os.path.isabs(model_name) else model_name,
                           device_str, dtype_name)
        except Exception as err:  # noqa: BLE001 (no torch, no CUDA torch)
            notes.append(f"transformers not run: {type(err).__name__}: {str(err)[:300]}")
            hf = None
    for B in rows_list:
        ids = rng.integers(3, config.vocab_size, (B, P)).astype(np.int32)
        mask = np.ones_like(ids)
        key = jax.random.key(0)

        def rljax_call():
            jax.block_until_ready(generate(model, ids, mask, key, sampling))

        rljax_call()  # compile
        t = median(timed(rljax_call, repeats))
        row = [B, P, N, t, B * N / t]
        if hf is not None:
            tid = torch.as_tensor(ids, dtype=torch.long, device=hf.device)
            tmask = torch.ones_like(tid)

            def hf_call(n=N):
                with torch.inference_mode():
                    hf.generate(input_ids=tid, attention_mask=tmask, do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
                if hf.device.type == "cuda":
                    torch.cuda.synchronize()

            hf_call(4)  # warm-up
            th = median(timed(hf_call, repeats))
            row += [th, B * N / th, th / t]
        else:
            row += ["-", "-", "-"]
        out_rows.append(row)
    return (f"`{model_name}`, random weights, {dtype_name}; random prompts of {P} tokens, exactly {N} new tokens "
            f"per row (EOS ignored), temperature 1; median of {repeats} after a warm-up; tokens/s counts new tokens."
            "\n\n" + table(["rows", "prompt", "new", "rljax s", "rljax tok/s", "transformers s", "transformers tok/s",
                            "rljax speed-up"], out_rows) + ("\n" + "\n".join(notes) + "\n" if notes else ""))


# ------------------------------------------------------------------------------------------- plan
def part_plan(label: str, results: dict, target: str) -> str:
    plan_run, _ = plan_api()
    measured = results.get(label)
    if measured is None:
        raise RuntimeError(f"no measurement of {label} to compare with (its speed part failed or was skipped)")
    cfg = measured["cfg"]
    report = plan_run(cfg, target)
    by_name = {p.name: p for p in report.programs}
    rows = []

    def err(plan, meas):
        return 100.0 * (plan - meas) / meas if meas else float("nan")

    upd = by_name["update"]
    if measured["peak_bytes"] is not None:
        rows.append(["update: peak memory (GiB)", upd.total_bytes / 2 ** 30, measured["peak_bytes"] / 2 ** 30,
                     err(upd.total_bytes, measured["peak_bytes"])])
    else:
        rows.append(["update: peak memory (GiB)", upd.total_bytes / 2 ** 30, "n/a", "-"])
    rows.append(["update: step time (s)", upd.time_s, measured["update_s"], err(upd.time_s, measured["update_s"])])
    if "scoring" in by_name:
        sc = by_name["scoring"]
        rows.append(["scoring: time (s)", sc.time_s, measured["score_s"], err(sc.time_s, measured["score_s"])])
    fit = f"fits: {report.fits} (of {report.memory_bytes / 2 ** 30:.1f} GiB usable per chip)"
    return (f"`rljax plan` of the speed run's config for `{target}` beside what the speed part measured; "
            f"error = (plan - measured) / measured. The plan's memory is the update program's per-chip total "
            f"(resident state + arguments + outputs + temporaries); its time is a roofline (a lower bound). {fit}."
            "\n\n" + table(["quantity", "plan", "measured", "plan error %"], rows))


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (JAX_PLATFORMS=cpu)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and steps: every part in seconds")
    parser.add_argument("--out", default=None, help="results file (default experiments/results/gpu_check_<gpu>.md)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip a part when less than its minimum time is left of this many seconds (default "
                        "450; 1800 with --smoke, which runs everything on a loaded CPU too)")
    parser.add_argument("--cache", default=None,
                        help="folder of pretrained arithmetic policies to reuse (paper_repro/_arith_policy.py; "
                             "default: one inside this check's work folder)")
    parser.add_argument("--skip-transformers", action="store_true", help="no transformers generate baseline")
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    start = time.perf_counter()
    deadline = start + (args.budget_s or (1800.0 if args.smoke else 450.0))

    def log(msg):
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    import jax

    device = jax.devices()[0]
    chip = gpu_name(device)
    out = args.out or os.path.join(ROOT, "experiments", "results", f"gpu_check_{chip}.md")
    mode = " (--cpu --smoke)" if args.cpu and args.smoke else " (--smoke)" if args.smoke else ""
    report = Report(out, f"GPU check on {device.device_kind}{mode}")
    report.set("Summary", f"Started {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                          "command: `python experiments/accel/gpu_check.py"
                          + (" --cpu" if args.cpu else "") + (" --smoke" if args.smoke else "") + "`; running.\n")
    work = tempfile.mkdtemp(prefix="gpu_check_") if args.smoke else os.path.join(ROOT, "runs", "accel")
    cache_root = args.cache or os.path.join(work, "cache")
    repeats = 2 if args.smoke else 3
    results: dict = {}
    smoke_peak = cpu_matmul_peak() if chip not in PEAK_BF16 else None
    peak, peak_what = peak_flops(device, smoke_peak)
    model_1_5b = MODEL_1_5B
    model_0_5b = os.path.join(work, "models", "qwen2.5-0.5b-shape")
    if args.smoke:
        from rljax.models.tiny import BYTE_VOCAB_SIZE, make_tiny_model_dir

        model_1_5b = make_tiny_model_dir(os.path.join(work, "models", "tiny"), layers=2, hidden=64, heads=4,
                                         kv_heads=2)
        del BYTE_VOCAB_SIZE
    else:
        import json

        os.makedirs(model_0_5b, exist_ok=True)
        with open(os.path.join(model_0_5b, "config.json"), "w") as f:
            json.dump(QWEN_0_5B, f, indent=1)
    target = f"{chip}-1" if chip in ("h100", "h200", "a100") else "cpu"
    # (name, function, seconds it needs at least to be worth starting)
    parts = [
        ("Environment", lambda: part_environment(device), 0),
        ("1a. Logits: device vs CPU", part_logits, 10),
        ("1b. Sampler vs trainer log-probs", part_logprobs, 10),
        ("1c. GRPO on the arithmetic policy",
         lambda: part_grpo(args.smoke, cache_root, work, log, max_rl_s=600 if args.smoke else 75), 60),
        ("2a. Speed: update and scoring, 1.5B", lambda: part_speed("1.5B", model_1_5b, args.smoke, results, peak,
                                                                   peak_what, repeats), 60),
        ("3a. Plan vs measured, 1.5B", lambda: part_plan("1.5B", results, target), 45),
        ("2b. Generation tokens/s vs transformers, 1.5B",
         lambda: part_generation(model_1_5b, args.smoke, args.skip_transformers, 2), 60),
    ]
    for name, fn, needs in parts:
        run_part(report, name, fn, log, deadline=deadline, needs_s=needs)
    failed = [k for k, v in report.sections.items() if v.startswith("FAILED")]
    skipped = [k for k, v in report.sections.items() if v.startswith("SKIPPED")]
    report.set("Summary", f"Command: `python experiments/accel/gpu_check.py" + (" --cpu" if args.cpu else "")
               + (" --smoke" if args.smoke else "") + f"`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
               f"{time.perf_counter() - start:.0f} s. Parts failed: {', '.join(failed) or 'none'}; skipped: "
               f"{', '.join(skipped) or 'none'}.\n")
    log(f"wrote {out}; failed: {failed or 'none'}; skipped: {skipped or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""``rljax plan``'s programs: the run's state and batches as sharded shapes, and the ahead-of-time
compiles of the update, the scoring passes and the sampler (:func:`plan_run`)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.errors import UserError
from rljax.models import model_config_for
from rljax.tools.plan.report import PlanReport, ProgramReport, _advice, _roofline
from rljax.tools.plan.targets import GiB, get_target, target_devices, usable_memory


def _key_dtype():
    return jax.eval_shape(lambda: jax.random.key(0)).dtype


def _spec(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def replication_fallbacks(state, mesh, rules) -> list[str]:
    """Parameters a rule asks to split over a mesh axis whose size does not divide the dimension
    (``rljax.sharding.logical_to_spec`` then replicates that dimension): ``["path: name=size / axis=size"]``."""
    from rljax.sharding import _rule_table

    table = _rule_table(rules)
    sizes = dict(mesh.shape)
    found = []
    for path, var in nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state():
        axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
        if not axes:
            continue
        spec = tuple(var.get_value().sharding.spec) + (None,) * len(axes)
        for i, (name, dim) in enumerate(zip(axes, var.get_value().shape)):
            target = table.get(name)
            wanted = [target] if isinstance(target, str) else list(target or [])
            got = spec[i] if isinstance(spec[i], tuple) else (spec[i],) if spec[i] else ()
            for axis in wanted:
                if sizes.get(axis, 1) > 1 and axis not in got and dim % sizes[axis]:
                    found.append(f"{'.'.join(str(p) for p in path)}: {name}={dim} not divisible by {axis}={sizes[axis]}")
    return found


# -------------------------------------------------------------------------------- the programs


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many collective ops of each kind the (optimised) HLO text holds: ``all-gather``,
    ``all-reduce``, ``reduce-scatter``, ``all-to-all``, ``collective-permute`` (async ``-start``
    halves counted once, ``-done`` not). Ops inside loops count once."""
    kinds = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    counts = {}
    for kind in kinds:
        n = len(re.findall(rf"\s{kind}(?:-start)?\(", hlo_text))
        if n:
            counts[kind] = n
    return counts


def analytic_flops(config, tokens_per_row: int, rows: int, *, passes: float, with_head: bool = True) -> float:
    """``2·N·tokens`` per forward pass (``passes`` forwards' worth: 1 scoring, 3 training = forward +
    backward, 2 for the backward of frozen (LoRA) weights), plus attention's ``4·T²·H·hd`` per layer
    and row per forward (full ``T×T`` scores: masked, not skipped). ``N`` counts the matmul weights
    (the embedding lookup is not a matmul; the LM head is, tied or not)."""
    c = config
    n_matmul = _matmul_params(config, with_head=with_head)
    tokens = rows * tokens_per_row
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * tokens_per_row ** 2 * rows
    return passes * (2 * n_matmul * tokens + attention)


def _matmul_params(config, *, with_head: bool = True) -> int:
    """Weights that enter a matmul per token: every layer's projections, and the LM head."""
    c = config
    attention = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    per_layer = attention + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + (c.hidden_size * c.vocab_size if with_head else 0)


def _chip_bytes(tree) -> int:
    """Bytes of one device's shards of a tree of sharded ``ShapeDtypeStruct`` s (the largest shard
    where a dimension does not divide evenly)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


_TRITON_TILING_FAILURE = "Couldn't find output tile sizes"


def _compile(name: str, what: str, jitted, args: tuple, kwargs: dict, analytic: float, *, state=()) -> ProgramReport:
    """Lower and compile ``jitted(*args, **kwargs)``; ``state``: the arguments that are persistent state."""
    report = ProgramReport(name, what, analytic_flops=analytic, state_arg_bytes=_chip_bytes(state))
    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    try:
        try:
            compiled = lowered.compile()
        except Exception as err:
            if _TRITON_TILING_FAILURE not in str(err):
                raise
            # XLA's GPU compiler, with no GPU to autotune on, found no Triton tiling for some f32 matmuls
            # (seen: a [55296, 256] weight gradient of paper_repro/online_vs_offline.py --full on
            # h100-1); the same program with cuBLAS matmuls compiles, and its buffers are the plan's
            compiled = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
            report.note = (f"{name}: compiled with xla_gpu_enable_triton_gemm=false (XLA found no Triton tiling for "
                           "a matmul without a GPU to autotune on; a GPU run may pick Triton kernels instead)")
        report.compile_s = time.perf_counter() - start
    except Exception as err:  # XlaRuntimeError: RESOURCE_EXHAUSTED ... CompileTimeHbmOom
        text = str(err)
        if "RESOURCE_EXHAUSTED" in text or "HbmOom" in text or "out of memory" in text.lower():
            report.oom = text.strip().splitlines()[0][:400]
            return report
        raise
    mem = compiled.memory_analysis()
    if mem is not None:
        report.argument_bytes = int(mem.argument_size_in_bytes)
        report.output_bytes = int(mem.output_size_in_bytes)
        report.alias_bytes = int(mem.alias_size_in_bytes)
        report.temp_bytes = int(mem.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else None
    if cost:
        report.flops = float(cost.get("flops", 0.0)) or None
        report.bytes_accessed = float(cost.get("bytes accessed", 0.0)) or None
    report.collectives = count_collectives(compiled.as_text())
    return report


def _count(state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def _placed(tree, mesh, rules):
    """``tree`` (shape-dtype structs) as ``sampler_weights`` places it on ``mesh`` by the rules."""
    from rljax.sharding import param_shardings

    return jax.tree.map(lambda x, sh: _spec(x.shape, x.dtype, sh), tree, param_shardings(tree, mesh, rules))


def _check_batch_split(rows: int, mesh, what: str) -> None:
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % split:
        raise UserError(f"{what} = {rows} rows cannot be split over mesh.data × mesh.fsdp = {split} devices: make "
                        f"the rows a multiple of {split}, or move devices to mesh.tensor")


def plan_run(cfg, target_name: str, *, memory_bytes: int | None = None) -> PlanReport:
    """Compile ``cfg``'s programs for ``target_name`` from shapes alone; see the module docstring.

    ``memory_bytes`` overrides the chip's memory (what the fit check compares against)."""
    from rljax.sharding import replicated, use_mesh
    from rljax.training.run import build_state, rollout_mesh, training_mesh
    from rljax.training.spec import run_spec
    from rljax.rollout import packing_group

    target = get_target(target_name)
    devices = target_devices(target)
    mesh = training_mesh(cfg, devices, counted=f"{target.name} has")
    rules = cfg.mesh.rule_table()
    spec = run_spec(cfg)
    algo, a = spec.algorithm, cfg.algorithm
    # disaggregated (mesh.rollout_devices): the first devices generate on a mesh of their own, as the trainer does
    gen_mesh = (rollout_mesh(cfg, devices) if algo.online else None) or mesh
    lora = bool(cfg.model.lora_rank)
    memory = memory_bytes if memory_bytes is not None else (usable_memory(target) or _host_memory() // target.num_devices)

    programs: list[ProgramReport] = []
    with use_mesh(mesh, rules):
        # the trainer's own state (rljax.training.run.build_state), as sharded shapes
        run_state = build_state(cfg, **spec.build_args(), mesh=mesh, rules=rules, abstract=True)
        config, p = run_state.model_config, run_state.policy
        graphdef, params, frozen, optimizer, opt_state = p.graphdef, p.params, p.frozen, p.optimizer, p.opt_state
        if algo.online:
            value_head = algo.value_head(a)
            R, P, N = spec.rows, _prompt_width(cfg), spec.completion_length
            _check_batch_split(R, mesh, "algorithm.prompts_per_step × group_size")
            batch = _rollout_batch(algo, a, R, P, N, mesh, rules, reference=spec.needs_reference,
                                   values=value_head is not None,
                                   # single-turn groups share their prompt (rljax.training.online.rollout_batch)
                                   prompt_group=1 if cfg.environment.name else packing_group(R, a.group_size,
                                                                                             a.num_micro))
            critic = {}
            if run_state.critic is not None:
                critic_config = model_config_for(spec.critic)
                c = run_state.critic
                critic = dict(critic_graphdef=c.graphdef, critic_params=c.params, critic_frozen=c.frozen,
                              critic_opt_state=c.opt_state, critic_optimizer=c.optimizer)
            critic_state = (critic["critic_params"], critic["critic_frozen"], critic["critic_opt_state"]) if critic else ()
            # what the trainer holds all step: policy, optimizer state, a full fine-tune's reference copy
            # (rljax.training.run.build_run: keep_reference when the algorithm needs one), the critic
            resident = _chip_bytes((params, frozen, opt_state, critic_state, run_state.ref_params))
            from rljax.training.online import score_logprobs, score_values, update_epochs

            train_passes = (2.0 if lora else 3.0) + (1.0 if cfg.model.remat != "none" else 0.0)
            analytic = analytic_flops(config, P + N, R, passes=train_passes * a.num_iterations)
            if critic:
                analytic += analytic_flops(critic_config, P + N, R, passes=(3.0 + (cfg.model.remat != "none"))
                                           * a.num_iterations, with_head=False)
            programs.append(_compile(
                "update", f"update_epochs: {a.num_iterations} pass(es) × {a.mini_batches} mini-batch(es) × "
                          f"{a.num_micro} micro-batch(es) of [{R} rows, {P}+{N} tokens]",
                update_epochs, (graphdef, params, frozen, opt_state, batch, _spec((), _key_dtype(),
                                                                                  replicated(mesh))),
                dict(optimizer=optimizer, algorithm=a.name, cfg=a, temperature=cfg.sampling.temperature,
                     num_micro=a.num_micro, num_iterations=a.num_iterations, mini_batches=a.mini_batches, **critic),
                analytic, state=(params, frozen, opt_state, critic_state)))
            # log-prob passes the trainer runs before the update (online.step_once): π_old, rescored for an
            # off-policy correction, and the reference's; one program (same function and shapes) compiled once
            scored = ([f"π_old log-probs of [{R} rows, {P}+{N} tokens] (algorithm.off_policy_correction: "
                       f"{a.off_policy_correction})"] if a.off_policy_correction != "none" else [])
            scored += [f"reference log-probs of [{R} rows, {P}+{N} tokens]"] if algo.needs_reference(a) else []
            if scored:
                first = _compile("scoring", f"score_logprobs: {scored[0]}", score_logprobs,
                                 (graphdef, params, frozen, batch), dict(temperature=cfg.sampling.temperature),
                                 analytic_flops(config, P + N, R, passes=1.0), state=(params, frozen))
                programs += [first] + [dataclasses.replace(first, what=f"score_logprobs: {w}", compile_s=0.0)
                                       for w in scored[1:]]
            if value_head is not None:
                separate = value_head == "separate"
                split = ((critic["critic_graphdef"], critic["critic_params"], critic["critic_frozen"]) if separate
                         else (graphdef, params, frozen))
                programs.append(_compile(
                    "values", f"score_values: {'the critic' if separate else 'the value head'}'s values of "
                              f"[{R} rows, {P}+{N} tokens]",
                    score_values, (*split, batch), {},
                    analytic_flops(critic_config if separate else config, P + N, R, passes=1.0, with_head=False),
                    state=split[1:]))
            gen_params, gen_frozen, gen_free = params, frozen, memory - resident
            if gen_mesh is not mesh:  # the sampler's copy, resharded onto the rollout devices after each update
                gen_params, gen_frozen = _placed(params, gen_mesh, rules), _placed(frozen, gen_mesh, rules)
                gen_resident = _chip_bytes((gen_params, gen_frozen))
                gen_free = memory - gen_resident
                _check_batch_split(R, gen_mesh, "algorithm.prompts_per_step × group_size (on mesh.rollout_devices)")
            with use_mesh(gen_mesh, rules):
                if cfg.sampling.engine == "paged":
                    generation = _engine(cfg, config, graphdef, gen_params, gen_frozen, R, P, N, gen_mesh, rules,
                                         gen_free)
                else:
                    generation = [_sampler(cfg, config, graphdef, gen_params, gen_frozen, R, P, N, gen_mesh, rules)]
            for g in generation:
                g.generation = True
            programs += generation
        else:
            B, P, N = spec.rows, _prompt_width(cfg), spec.completion_length
            _check_batch_split(B, mesh, "algorithm.batch_size")
            batch, K = _offline_batch(spec, a, B, P, N, mesh, rules)
            # a reference copy only for live reference log-probs of a full fine-tune (else cached once)
            resident = _chip_bytes((params, frozen, opt_state, run_state.ref_params))
            from rljax.training.offline import offline_update, score_batch

            train_passes = (2.0 if lora else 3.0) + (1.0 if cfg.model.remat != "none" else 0.0)
            programs.append(_compile(
                "update", f"offline_update: {a.num_micro} micro-batch(es) of [{B} rows × {K} completions, "
                          f"{P}+{N} tokens]",
                offline_update, (graphdef, params, frozen, opt_state, batch),
                dict(optimizer=optimizer, algorithm=a.name, cfg=a, num_micro=a.num_micro),
                analytic_flops(config, P + N, B * K, passes=train_passes), state=(params, frozen, opt_state)))
            if spec.needs_reference:
                E = a.eval_batch_size
                eval_batch, _ = _offline_batch(spec, a, E, P, N, mesh, rules)
                programs.append(_compile(
                    "scoring", f"score_batch: reference log-probs of [{E} rows × {K} completions, {P}+{N} tokens]",
                    score_batch, (graphdef, params, frozen, eval_batch), dict(algorithm=a.name),
                    analytic_flops(config, P + N, E * K, passes=1.0), state=(params, frozen)))
    apart = gen_mesh is not mesh
    for p in programs:
        on_rollout = apart and p.generation
        p.resident_bytes = gen_resident if on_rollout else resident
        p.devices = (gen_mesh if on_rollout else mesh).size
        _roofline(p, target.spec, p.devices)
        p.in_step = algo.online or p.name == "update"
    report = PlanReport(target, memory, dict(mesh.shape), cfg.model.name, _count(params) + _count(frozen),
                        _count(params), programs, replication_fallbacks(params, mesh, rules)
                        + replication_fallbacks(frozen, mesh, rules), [])
    if apart:
        report.rollout_devices = gen_mesh.size
        # what the trainer sends after each update (rljax.training.asynchronous.sampler_weights): the
        # trainable parameters; the frozen ones are placed once
        report.weight_sync_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                                       for x in jax.tree.leaves(params))
    report.advice = _advice(report, cfg)
    return report


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def _prompt_width(cfg) -> int:
    from rljax.buckets import bucket_length

    return bucket_length(cfg.data.max_prompt_length, 16)  # the widest prompt bucket a batch can have


def _rollout_batch(algo, a, R, P, N, mesh, rules, *, reference: bool, values: bool, prompt_group: int = 1):
    """The update's ``RolloutBatch`` as sharded shapes (rows over the batch axes), advantages filled
    by the algorithm's own function (traced, not run)."""
    from rljax.batches import RolloutBatch
    from rljax.sharding import batch_sharding

    rows = batch_sharding(mesh, rules)
    i32, f32 = jnp.int32, jnp.float32
    base = RolloutBatch(
        prompt_ids=_spec((R, P), i32, rows), prompt_mask=_spec((R, P), i32, rows),
        completion_ids=_spec((R, N), i32, rows), completion_mask=_spec((R, N), i32, rows),
        loss_mask=_spec((R, N), i32, rows), old_logprobs=_spec((R, N), f32, rows), scores=_spec((R,), f32, rows),
        row_mask=_spec((R,), jnp.bool_, rows), finished=_spec((R,), jnp.bool_, rows),
        ref_logprobs=_spec((R, N), f32, rows) if reference else None,
        old_values=_spec((R, N), f32, rows) if values else None, prompt_group=prompt_group,
        # with an off-policy correction the sampler's log-probs travel beside the recomputed π_old
        sampling_logprobs=_spec((R, N), f32, rows) if a.off_policy_correction != "none" else None)
    state = algo.start_state(a)
    filled = jax.eval_shape(lambda b: algo.advantages_and_state(b, a, state)[0], base)
    return jax.tree.map(lambda x: _spec(x.shape, x.dtype, rows), filled)


def _offline_batch(spec, a, B, P, N, mesh, rules):
    """The update's batch as sharded shapes: the data kind's own abstract batch (``rljax.data.kinds``),
    rows over the batch axes; returns it and its completions per row."""
    from rljax.data.kinds import get_kind
    from rljax.sharding import batch_sharding

    rows = batch_sharding(mesh, rules)
    kind = get_kind(spec.batch_kind)
    shapes = kind.abstract_batch(B, P, N, a, reference=spec.needs_reference)
    return jax.tree.map(lambda x: _spec(x.shape, x.dtype, rows), shapes), kind.completions(a)


def _sampler(cfg, config, graphdef, params, frozen, R, P, N, mesh, rules) -> ProgramReport:
    """The sampler's program for one step's rollouts (batch and prompt width bucketed as ``generate`` does)."""
    from rljax.buckets import bucket_length
    from rljax.sampling import SamplingConfig, _generate
    from rljax.sharding import batch_sharding, replicated

    B = bucket_length(R, 8)
    rows = batch_sharding(mesh, rules)
    s = cfg.sampling
    sampling = SamplingConfig(max_new_tokens=N, temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p,
                              stop_token_ids=config.eos_token_ids, ignore_eos=s.ignore_eos,
                              pad_token_id=config.pad_token_id or 0)
    ids = _spec((B, P), jnp.int32, rows)
    key = _spec((), _key_dtype(), replicated(mesh))
    # prefill of [B, P], then one decode step: one token per row against P + N cached keys
    c = config
    decode = B * (2 * _matmul_params(config) + 4 * c.num_layers * c.num_heads * c.head_dim * (P + N))
    report = _compile("sampler", f"generate: prefill [{B} rows, {P} tokens] + decode loop to {N} new tokens "
                                 "(XLA's cost: prefill + one decode step)",
                      _generate, (graphdef, (params, frozen), ids, ids, key, sampling), {},
                      analytic_flops(config, P, B, passes=1.0) + decode, state=(params, frozen))
    n = mesh.devices.size
    itemsize = jnp.dtype(_dtype_of(cfg)).itemsize
    cache = 2 * c.num_layers * B * (P + N) * c.num_kv_heads * c.head_dim * itemsize
    weights = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves((params, frozen)))
    report.decode_steps, report.decode_flops, report.decode_bytes = N - 1, decode, (weights + cache) / n
    return report


def _engine(cfg, config, graphdef, params, frozen, R, P, N, mesh, rules, free_bytes) -> list[ProgramReport]:
    """The rollout engine's programs (``rljax.inference.model_step``): the prefill of a full set of
    slots' prompts and one decode step of every slot, over a page pool as large as the step's rows
    need; the decode report's note says how many KV pages (concurrent tokens) fit per chip beside
    the run's state and the decode step's temporaries."""
    from jax.sharding import NamedSharding

    from rljax.buckets import bucket_length
    from rljax.inference import model_step
    from rljax.inference.attention import POOL_AXES, pool_shapes
    from rljax.inference.engine import live_pages_bucket
    from rljax.sharding import logical_to_spec, replicated

    s, c = cfg.sampling, config
    S, ps = s.max_slots, s.page_size
    rows = min(R, S)  # sequences in flight at once
    per_seq = math.ceil((P + N) / ps)
    num_pages = rows * per_seq + 1
    itemsize = jnp.dtype(_dtype_of(cfg)).itemsize
    pools = [_spec(shape, _dtype_of(cfg), NamedSharding(mesh, logical_to_spec(POOL_AXES, shape, mesh, rules)))
             for shape in pool_shapes(num_pages, ps, c.num_kv_heads, c.head_dim)]
    kv = tuple(tuple(pool for _ in range(c.num_layers)) for pool in pools)
    rep = replicated(mesh)
    i32, f32 = jnp.int32, jnp.float32
    states = (params, frozen)
    # the decode weights as the engine holds them: the output of their own program, laid out by XLA
    compiled = model_step.decode_weights.lower(graphdef, states).compile()
    weights = jax.tree.map(lambda x, sh: _spec(x.shape, x.dtype, sh),
                           jax.eval_shape(lambda st: model_step.decode_weights(graphdef, st), states),
                           compiled.output_shardings)
    T, width = bucket_length(P, 16, 1), bucket_length(math.ceil(P / ps), 1, 1)
    Rp = bucket_length(rows, 1, 1)
    prefill = _compile(
        "engine prefill", f"prefill: [{Rp} rows, {T} tokens] into pages of {ps}",
        model_step.prefill, (graphdef, states, weights, kv, _spec((Rp, T), i32, rep), _spec((Rp,), i32, rep),
                             _spec((Rp,), i32, rep), _spec((Rp, width), i32, rep)), {},
        analytic_flops(config, P, rows, passes=1.0), state=states)
    prefill.decode_steps = 0
    sampling = {"seed": _spec((S,), jnp.uint32, rep), "counter": _spec((S,), i32, rep),
                "temperature": _spec((S,), f32, rep), "top_k": _spec((S,), i32, rep), "top_p": _spec((S,), f32, rep)}
    live = live_pages_bucket(rows * per_seq)
    filtered = bool(s.top_k) or s.top_p < 1
    step = S * (2 * _matmul_params(config) + 4 * c.num_layers * c.num_heads * c.head_dim * (P + N // 2))
    decode = _compile(
        "engine decode", f"decode: one token for each of {S} slots, ragged attention over {live} live pages",
        model_step.decode, (graphdef, states, weights, kv, _spec((S,), i32, rep), _spec((S,), i32, rep),
                            _spec((S,), i32, rep), _spec((S, per_seq), i32, rep), sampling),
        dict(live_pages=live, filtered=filtered), step, state=states)
    n = mesh.devices.size
    weight_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(states))
    kv_read = 2 * c.num_layers * rows * (P + N // 2) * c.num_kv_heads * c.head_dim * itemsize
    steps = math.ceil(R / S) * N
    decode.decode_steps, decode.decode_flops, decode.decode_bytes = steps - 1, step, (weight_bytes + kv_read) / n
    page_bytes = _chip_bytes(kv) / num_pages  # a page holds its tokens' keys and values in every layer
    fit = int(max(free_bytes - decode.temp_bytes - _chip_bytes(weights), 0) // page_bytes)
    decode.note = (f"KV pages per chip: {fit:,} of {ps} tokens ({fit * ps:,} concurrent tokens) beside the run's "
                   f"state, the decode weights and the decode step's temporaries; this step needs "
                   f"{rows * per_seq:,} ({rows} sequences of up to {P}+{N} tokens)")
    return [prefill, decode]


def _dtype_of(cfg):
    from rljax.models import dtype_from_name

    return dtype_from_name(cfg.model.dtype)

"""Does rljax's paged attention compile for a TPU target from a CPU host (no TPU needed)?

Compiles each path of ``ragged_paged_attention`` (the Pallas TPU kernel, the dense gather, the
ragged decode) for one device of an abstract v5e:2x2 topology and prints whether the Pallas kernel
is in the program (``tpu_custom_call``) and the temporaries. Needs libtpu, kept out of the shared
venv (docs/paged-attention.md):

    pip install --target /tmp/libtpu --no-deps libtpu==0.0.42.1
    TPU_WORKER_HOSTNAMES=localhost TPU_ACCELERATOR_TYPE=v5litepod-4 \
        PYTHONPATH=$PWD:/tmp/libtpu python experiments/perf/paged_attention_tpu_compile.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from rljax.inference.attention import pool_shapes, ragged_paged_attention

# (rows, query tokens, page-table width, pages, KV heads, head dim, query heads, dtype)
SHAPES = [(64, 1, 32, 2048, 3, 64, 9, jnp.float32),  # SmolLM2-135M decode
          (8, 64, 32, 2048, 2, 128, 12, jnp.bfloat16)]  # a Qwen2.5-1.5B-like prefill chunk


def main():
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                            chips_per_host_bounds=(2, 2, 1), num_slices=1,
                                            wrap=(False, False, False))
    device = topology.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    print(device.device_kind)
    for R, T, P, N, KVH, hd, H, dtype in SHAPES:
        args = (spec((R, T, H, hd), dtype), *(spec(shape, dtype) for shape in pool_shapes(N, 16, KVH, hd)),
                spec((R, P)), spec((R,)), spec((R,)), spec((R,)))
        for impl in ("pallas", "dense") + (("ragged",) if T == 1 else ()):
            kw = {"impl": impl, "live_pages": R * 8 if impl == "ragged" else None}
            name = f"R={R} T={T} KVH={KVH} hd={hd} {jnp.dtype(dtype).name} {impl}"
            try:
                # The kernel's Mosaic lowering asks the default device which chip it targets.
                with jax.default_device(device):
                    compiled = jax.jit(lambda *a, kw=kw: ragged_paged_attention(*a, **kw)).trace(*args).lower().compile()
            except Exception as e:  # report and go on: which shapes the kernel refuses is the answer
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            print(f"{name}: compiled, temporaries {temp:.1f} MiB, Pallas kernel: {'tpu_custom_call' in compiled.as_text()}")


if __name__ == "__main__":
    main()

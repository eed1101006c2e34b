"""The rollout engine: continuous batching over a paged KV cache (:mod:`rljax.inference.engine`),
ragged paged attention (:mod:`rljax.inference.attention`), the page allocator and prefix cache
(:mod:`rljax.inference.pages`) and the device programs (:mod:`rljax.inference.model_step`)."""

from rljax.inference.engine import Engine, Output, Request

__all__ = ["Engine", "Output", "Request"]

"""``rljax serve``: an OpenAI-compatible HTTP server over the rollout engine (:mod:`rljax.serve.app`),
the wire format (:mod:`rljax.serve.protocol`) and the thread that owns the engine
(:mod:`rljax.serve.driver`)."""

from rljax.serve.app import CallRecord, ChoiceRecord, Server, check_bind
from rljax.serve.driver import EngineDriver

__all__ = ["CallRecord", "ChoiceRecord", "EngineDriver", "Server", "check_bind"]

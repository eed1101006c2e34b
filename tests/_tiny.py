"""Tiny model helpers for tests (the builders live in :mod:`rljax.models.tiny`)."""

from rljax.models.tiny import CHATML, byte_tokenizer, make_tiny_model_dir

tiny_tokenizer = byte_tokenizer

__all__ = ["CHATML", "make_tiny_model_dir", "tiny_tokenizer"]

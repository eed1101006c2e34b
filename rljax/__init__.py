"""rljax: reinforcement-learning fine-tuning of language models in JAX."""

__version__ = "0.1.0"

"""rljax: reinforcement-learning fine-tuning of language models in JAX."""

from rljax.host_memory import keep_host_memory

keep_host_memory()  # before JAX's threads start: see rljax/host_memory.py

__version__ = "0.1.0"

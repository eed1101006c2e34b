"""rljax: reinforcement-learning fine-tuning of language models in JAX.

Importing rljax changes nothing process-wide: the glibc malloc settings of rljax/host_memory.py are
applied by the entry points that run long jobs (``rljax train | eval | generate``), not on import.
"""

__version__ = "0.1.0"

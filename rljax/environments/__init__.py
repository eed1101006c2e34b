"""Text environments (Gymnasium's ``reset`` / ``step`` over chat messages), tools, and multi-turn rollouts.

``base``: the ``Environment`` interface and its registry; ``tools``: tools with JSON schemas, the
tool-call format and ``ToolEnvironment``; ``episodes``: multi-turn rollouts and their credit;
``calculator`` and ``toy``: environments.
"""

from rljax.environments.base import Environment, build_environment, register_environment, registered_environments

__all__ = ["Environment", "build_environment", "register_environment", "registered_environments"]

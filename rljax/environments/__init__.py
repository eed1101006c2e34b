"""Text environments, tools, multi-turn rollouts, and the verifiers that execute model output.

``base``        the ``Environment`` interface (Gymnasium's ``reset`` / ``step`` over chat messages) and
                its registry
``tools``       tools with JSON schemas, the tool-call format and ``ToolEnvironment``
``episodes``    multi-turn rollouts and their credit
``calculator``, ``toy``  environments
``sandbox``     ``run_python``: untrusted Python as an unprivileged user with rlimits, a scratch
                directory, an empty environment and bwrap's namespaces (no network, read-only files);
                refused without bwrap unless ``allow_unsandboxed`` (docs/sandbox.md)
``code_tasks``  data task ``code`` (function-writing problems with hidden unit tests) and reward
                ``code_tests``; ``check_code`` for a multi-turn retry environment
``sql_tasks``   data task ``sql`` (a fresh SQLite database per question, a gold query) and rewards
                ``sql_result`` and ``sql_executes``; ``check_sql`` runs a query read-only with a time limit

Importing this package registers its data tasks and rewards (``rljax.training.data`` imports it).
"""

from rljax.environments import code_tasks  # noqa: F401 - registers task "code", reward "code_tests"
from rljax.environments import sql_tasks  # noqa: F401 - registers task "sql", reward "sql_result"
from rljax.environments.base import Environment, build_environment, register_environment, registered_environments

__all__ = ["Environment", "build_environment", "register_environment", "registered_environments"]

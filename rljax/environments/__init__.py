"""Text environments, tools, and the verifiers that execute model output.

``sandbox``     ``run_python``: untrusted Python in a process group with rlimits, a scratch directory,
                an empty environment and, where bwrap works, namespaces (no network, read-only files)
"""

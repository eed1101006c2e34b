"""The import contracts of pyproject.toml ([tool.importlinter]) hold.

One test per contract, each a run of import-linter's `lint-imports` on this checkout, so a broken
contract is named by its test and the failure shows import-linter's report (the offending import
chains and line numbers). CI also runs `lint-imports` on its own (.ci/run).
"""

import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    CONTRACTS = tomllib.load(f)["tool"]["importlinter"]["contracts"]
# lint-imports is a console script; run its entry point with this interpreter so no PATH is needed.
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_every_contract_has_an_id():
    assert CONTRACTS and all(c.get("id") for c in CONTRACTS)


@pytest.mark.parametrize("contract", [c["id"] for c in CONTRACTS])
def test_contract_is_kept(contract):
    # PYTHONPATH: analyse this checkout's rljax, whatever else is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo", "--contract", contract],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout, run.stdout

"""``RLJAX_TEST_COMPILE_LOG`` (tests/conftest.py): a pytest run writes one line per test with the
seconds JAX spent tracing, lowering and compiling, and the programs it compiled, per function."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TESTS = '''
import jax
import jax.numpy as jnp


def test_two_programs():
    jax.jit(lambda x: x * 2.0)(jnp.ones(3))
    jax.jit(lambda x: jnp.sin(x).sum())(jnp.ones(5))


def test_nothing_compiled():
    assert 1 + 1 == 2
'''


def test_each_test_gets_a_line_with_its_compile_phases(tmp_path):
    # a test file inside the repository's tests/ package, so tests/conftest.py applies to it
    folder = os.path.join(REPO, "tests", "system")
    path = os.path.join(folder, f"_compile_log_probe_{os.getpid()}.py")
    log = tmp_path / "compile.tsv"
    with open(path, "w") as f:
        f.write(TESTS)
    try:
        env = dict(os.environ, RLJAX_TEST_COMPILE_LOG=str(log), JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", path],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=600)  # a hang guard
    finally:
        os.remove(path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.rstrip("\n").split("\t") for line in log.read_text().splitlines()]
    assert [r[0].split("::")[1] for r in rows] == ["test_two_programs", "test_nothing_compiled"]
    two, none = rows
    assert len(two) == 9 and int(two[7]) >= 2 and float(two[6]) > 0 and float(two[4]) > 0  # compiled and traced
    assert int(none[7]) == 0 and float(none[6]) == 0.0 and none[8] == ""
    # per compiled function, name=count:seconds: as many programs as counted, named after the functions
    functions = {fun: rest.split(":") for fun, _, rest in (item.rpartition("=") for item in two[8].split(";"))}
    assert sum(int(n) for n, _ in functions.values()) == int(two[7]), two[8]
    assert any("lambda" in fun for fun in functions), two[8]
    assert abs(sum(float(s) for _, s in functions.values()) - float(two[6])) < 0.01, two  # the compile seconds
    assert float(two[1]) >= float(two[6])  # wall time holds the compile time

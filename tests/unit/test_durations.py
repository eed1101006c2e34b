"""tests/durations.py: per-tier and per-file totals and the slow unit tests, from a hand-made JUnit file."""
import io

from tests import durations

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.unit.test_a" name="test_quick" time="0.5"/>
<testcase classname="tests.unit.test_a" name="test_slow[x]" time="7.25"/>
<testcase classname="tests.unit.test_b.TestGroup" name="test_in_a_class" time="1.0"><skipped/></testcase>
<testcase classname="tests.integration.test_c" name="test_run" time="30.0"><failure message="no"/></testcase>
<testcase classname="tests.system.test_d" name="test_procs" time="12.0"/>
</testsuite></testsuites>
"""


def test_totals_by_tier_and_file_and_the_unit_tests_over_the_limit(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(XML)
    cases = durations.read_cases([path])
    assert [(f, o) for f, _, _, o in cases] == [
        ("tests/unit/test_a.py", "passed"), ("tests/unit/test_a.py", "passed"), ("tests/unit/test_b.py", "skipped"),
        ("tests/integration/test_c.py", "failure"), ("tests/system/test_d.py", "passed")]
    out = io.StringIO()
    slow = durations.report(cases, unit_limit=5, top=2, out=out)
    assert slow == [(7.25, "tests/unit/test_a.py", "test_slow[x]")]
    lines = out.getvalue().splitlines()
    assert lines[1].split() == ["unit", "3", "8.8"]  # 0.5 + 7.25 + 1.0
    assert lines[2].split() == ["integration", "1", "30.0"]
    assert lines[3].split() == ["system", "1", "12.0"]
    assert lines[4].split() == ["all", "5", "50.8"]
    assert [line.split()[1] for line in lines[7:9]] == ["tests/integration/test_c.py", "tests/system/test_d.py"]
    assert durations.main([str(path), "--check", "--unit-limit", "8"]) == 0
    assert durations.main([str(path), "--check"]) == 1
    assert durations.main([str(path)]) == 0


# RLJAX_TEST_COMPILE_LOG lines (tests/conftest.py): id, wall, cpu, children's cpu, trace, lower, compile, programs
COMPILE_LOG = ("tests/integration/test_c.py::test_a\t10.0\t9.0\t0.0\t1.0\t2.0\t5.0\t7\n"
               "tests/integration/test_c.py::test_b[x]\t4.0\t3.5\t0.0\t0.5\t0.5\t2.0\t3\n"
               "tests/system/test_d.py::test_procs\t20.0\t1.0\t30.0\t0.0\t0.0\t0.5\t1\n")


def test_the_compile_log_splits_each_files_cpu_into_compile_phases(tmp_path):
    path = tmp_path / "compile.tsv"
    path.write_text(COMPILE_LOG)
    out = io.StringIO()
    total = durations.compile_report([path], top=5, out=out)
    lines = out.getvalue().splitlines()
    # the subprocesses' 30 s put test_d first; rest = cpu - trace - lower - compile
    assert lines[2].split() == ["20.0", "1.0", "0.0", "0.0", "0.5", "0.5", "30.0", "1", "tests/system/test_d.py"]
    assert lines[3].split() == ["14.0", "12.5", "1.5", "2.5", "7.0", "1.5", "0.0", "10", "tests/integration/test_c.py"]
    assert lines[4].split()[:8] == ["34.0", "13.5", "1.5", "2.5", "7.5", "2.0", "30.0", "11"]
    assert total["programs"] == 11 and total["compile"] == 7.5
    assert len(lines) == 5  # lines without the per-function field (older logs) list no functions


# the same lines with the per-function field (name=count:seconds joined by ";"), and one without programs
COMPILE_LOG_FUNCTIONS = "".join(
    f"{line}\t{functions}\n" for line, functions in zip(
        COMPILE_LOG.splitlines(), ["jit_update_epochs=2:4.000;jit_sum=5:1.000", "jit_update_epochs=3:2.000",
                                   "jit_sum=1:0.500"])
) + "tests/system/test_d.py::test_none\t1.0\t1.0\t0.0\t0.0\t0.0\t0.0\t0\t\n"


def test_the_compile_log_lists_the_compiled_functions_by_compile_seconds(tmp_path):
    path = tmp_path / "compile.tsv"
    path.write_text(COMPILE_LOG_FUNCTIONS)
    out = io.StringIO()
    total = durations.compile_report([path], top=5, out=out)
    lines = out.getvalue().splitlines()
    assert total["programs"] == 11 and total["wall"] == 35.0  # the per-function field does not shift the columns
    start = next(i for i, line in enumerate(lines) if line.startswith("compiled programs by function"))
    # seconds, programs, files: update_epochs 4 + 2 s in 2 + 3 programs of one file; sum 1 + 0.5 s in 5 + 1 of two
    assert [line.split() for line in lines[start + 2:]] == [["6.0", "5", "1", "jit_update_epochs"],
                                                           ["1.5", "6", "2", "jit_sum"]]

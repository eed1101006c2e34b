"""Per-tier and per-file test times from pytest's JUnit XML, and the unit tests over a time limit.

    python -m pytest tests/unit --junitxml=unit.xml   # or the whole suite
    python tests/durations.py unit.xml [more.xml ...] [--unit-limit 5] [--top 15] [--check]
    python tests/durations.py --run tests/unit [pytest args ...]   # runs pytest with a JUnit file, then reports
    RLJAX_TEST_COMPILE_LOG=c.tsv python -m pytest tests/integration && python tests/durations.py --compile-log c.tsv

A test's time is JUnit's (setup + call + teardown, so a module fixture counts in its first test).
``--check`` exits 1 when a unit test takes longer than ``--unit-limit`` seconds, so the quick loop
(``python -m pytest tests/unit``) stays quick; such a test belongs in tests/integration/.
``--compile-log`` reads the per-test file that ``RLJAX_TEST_COMPILE_LOG`` makes ``tests/conftest.py``
write and splits each file's CPU time into JAX tracing, lowering, XLA compiling, the rest of the
process (running, Python) and its finished subprocesses, then lists the compiled functions by their
compile seconds (how many programs each, from how many files): which programs to share.
"""
import argparse
import collections
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

TIERS = ("unit", "integration", "system")


def read_cases(paths):
    """``[(file, test name, seconds, outcome)]`` from JUnit XML files (``tests/<tier>/test_x.py`` names)."""
    cases = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")
            module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
            file = "/".join(parts[:module + 1]) + ".py"
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            cases.append((file, case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return cases


def tier_of(file):
    parts = file.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else "other"


def report(cases, *, unit_limit, top, out=sys.stdout):
    """Prints the totals; returns the unit tests slower than ``unit_limit`` seconds."""
    by_tier, by_file, counts = collections.Counter(), collections.Counter(), collections.Counter()
    for file, _, seconds, _ in cases:
        by_tier[tier_of(file)] += seconds
        by_file[file] += seconds
        counts[tier_of(file)] += 1
    total = sum(by_tier.values())
    print(f"{'tier':<12} {'tests':>6} {'seconds':>9}  (summed over workers; wall time is about this / -n)", file=out)
    for tier in (*TIERS, "other"):
        if counts[tier]:
            print(f"{tier:<12} {counts[tier]:>6} {by_tier[tier]:>9.1f}", file=out)
    print(f"{'all':<12} {len(cases):>6} {total:>9.1f}", file=out)
    print(f"\nfiles, slowest first (top {top} of {len(by_file)}):", file=out)
    for file, seconds in by_file.most_common(top):
        print(f"{seconds:>9.1f}  {file}", file=out)
    slow = sorted(((s, f, n) for f, n, s, _ in cases if tier_of(f) == "unit" and s > unit_limit), reverse=True)
    if slow:
        print(f"\nunit tests over {unit_limit:g} s (move them to tests/integration/ or make them quicker):", file=out)
        for seconds, file, name in slow:
            print(f"{seconds:>9.1f}  {file}::{name}", file=out)
    return slow


def compile_report(paths, *, top, out=sys.stdout):
    """Per-file CPU seconds from ``RLJAX_TEST_COMPILE_LOG`` files, split by JAX's compile phases."""
    columns = ("wall", "cpu", "children", "trace", "lower", "compile", "programs")
    by_file = collections.defaultdict(lambda: collections.Counter())
    # per compiled function: programs, compile seconds, and the files that compiled it
    programs, program_seconds = collections.Counter(), collections.Counter()
    program_files = collections.defaultdict(set)
    for path in paths:
        with open(path) as f:
            for line in f:
                nodeid, *values = line.rstrip("\n").split("\t")
                file = nodeid.split("::")[0]
                by_file[file].update(dict(zip(columns, map(float, values[:len(columns)]))))
                functions = values[len(columns)] if len(values) > len(columns) else ""  # absent in older logs
                for item in filter(None, functions.split(";")):
                    fun, _, rest = item.rpartition("=")
                    count, _, seconds = rest.partition(":")
                    programs[fun] += int(count)
                    program_seconds[fun] += float(seconds)
                    program_files[fun].add(file)
    total = collections.Counter()
    for counts in by_file.values():
        total.update(counts)
    head = (f"{'wall':>8} {'cpu':>8} {'trace':>7} {'lower':>7} {'compile':>8} {'rest':>8} {'subproc':>8} "
            f"{'programs':>8}  file")
    print("seconds per file, summed over its tests (cpu = this process; rest = cpu - trace - lower - compile)",
          file=out)
    print(head, file=out)

    def row(name, c):
        rest = c["cpu"] - c["trace"] - c["lower"] - c["compile"]
        return (f"{c['wall']:>8.1f} {c['cpu']:>8.1f} {c['trace']:>7.1f} {c['lower']:>7.1f} {c['compile']:>8.1f} "
                f"{rest:>8.1f} {c['children']:>8.1f} {c['programs']:>8.0f}  {name}")

    for file, counts in sorted(by_file.items(), key=lambda kv: -kv[1]["cpu"] - kv[1]["children"])[:top]:
        print(row(file, counts), file=out)
    print(row(f"all {len(by_file)} files", total), file=out)
    if programs:
        print(f"\ncompiled programs by function, most compile seconds first (top {top} of {len(programs)}; "
              "a program loaded from the persistent cache counts, with its load time):", file=out)
        print(f"{'seconds':>8} {'programs':>8} {'files':>5}  function", file=out)
        for fun, seconds in program_seconds.most_common(top):
            print(f"{seconds:>8.1f} {programs[fun]:>8d} {len(program_files[fun]):>5d}  {fun}", file=out)
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="*", help="JUnit XML files written by pytest --junitxml")
    parser.add_argument("--run", nargs=argparse.REMAINDER, help="run pytest with these arguments, then report")
    parser.add_argument("--unit-limit", type=float, default=5.0, help="seconds a unit test may take (default 5)")
    parser.add_argument("--top", type=int, default=15, help="how many files to list (default 15)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a unit test is over --unit-limit")
    parser.add_argument("--compile-log", nargs="+", default=[], metavar="TSV",
                        help="files written through RLJAX_TEST_COMPILE_LOG: report JAX's compile phases per file")
    args = parser.parse_args(argv)
    if args.compile_log:
        compile_report(args.compile_log, top=args.top)
        if not args.xml and args.run is None:
            return 0
    paths, rc = list(args.xml), 0
    if args.run is not None:
        fd, path = tempfile.mkstemp(suffix=".xml")
        os.close(fd)
        rc = subprocess.call([sys.executable, "-m", "pytest", *args.run, f"--junitxml={path}"])
        paths.append(path)
    if not paths:
        parser.error("give JUnit XML files or --run PYTEST_ARGS")
    slow = report(read_cases(paths), unit_limit=args.unit_limit, top=args.top)
    return rc or (1 if args.check and slow else 0)


if __name__ == "__main__":
    sys.exit(main())

"""Where the suite's CPU goes, test by test: a pytest plugin, for one test at a time.

    PYTHONPATH=tests TEST_WORKERS=0 bash launch/test.sh -p cpu_report

`make test` is CPU-bound on 2 cores (the cores are over 90% busy through the run), so its
time falls only with the CPU it spends, and per-test wall times under pytest-xdist mostly say
how busy the other worker was. Most of that CPU is not the test's own process: notebook
kernels, ranks and their fork servers, Chromium, the grader's processes, none of them children
that the test waits for, so resource.getrusage misses them. One test at a time, on a machine
doing nothing else, the machine's own count (/proc/stat) charges each test everything that ran
while it did: its setup (a session fixture's work lands on the first test that needs it), call
and teardown. Anything else running (another test suite, a build) is charged too.

At the end it prints the units of work (tests/conftest.py's ``unit_of``: a file, a shared
fixture, a benchmark) and the tests that spent the most, and writes every test's CPU-seconds
and seconds to out/cpu_report.json (ULTRASCALE_CPU_REPORT names another file). Under -n 2 the
numbers overlap and mean nothing: it says so and writes nothing. Linux only (/proc/stat).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROWS: dict[str, tuple[float, float]] = {}  # nodeid -> (machine CPU-seconds, seconds)


def _machine_cpu_seconds() -> float:
    """CPU-seconds all cores have spent busy since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, start = _machine_cpu_seconds(), time.monotonic()
    yield
    ROWS[item.nodeid] = (_machine_cpu_seconds() - cpu, time.monotonic() - start)


def _unit(nodeid: str) -> str:
    try:
        from conftest import unit_of  # tests/conftest.py, on the path when tests/ is collected
    except ImportError:
        return nodeid.split("::")[0]
    return unit_of(nodeid)


def pytest_terminal_summary(terminalreporter, config):
    write = terminalreporter.write_line
    if getattr(config.option, "numprocesses", None):
        write(
            "cpu_report: tests ran side by side (-n): per-test CPU would overlap; nothing measured "
            "(TEST_WORKERS=0 runs one at a time)"
        )
        return
    if not ROWS:
        return
    units = defaultdict(lambda: [0.0, 0.0])
    for nodeid, (cpu, seconds) in ROWS.items():
        unit = units[_unit(nodeid)]
        unit[0] += cpu
        unit[1] += seconds
    total = sum(cpu for cpu, _ in ROWS.values())
    write(
        f"cpu_report: {total:.0f} CPU-s over {len(ROWS)} tests, {sum(s for _, s in ROWS.values()):.0f} s one at a time"
    )
    for title, rows in (("units", units.items()), ("tests", ROWS.items())):
        write(f"{'CPU-s':>8} {'s':>7}  most CPU, by {title[:-1]}")
        for name, (cpu, seconds) in sorted(rows, key=lambda row: -row[1][0])[:25]:
            write(f"{cpu:8.1f} {seconds:7.1f}  {name}")
    out = Path(os.environ.get("ULTRASCALE_CPU_REPORT", Path(config.rootpath) / "out" / "cpu_report.json"))
    out.parent.mkdir(parents=True, exist_ok=True)

    def rounded(rows):
        return {name: {"cpu_s": round(cpu, 2), "s": round(seconds, 2)} for name, (cpu, seconds) in rows.items()}

    out.write_text(json.dumps({"tests": rounded(ROWS), "units": rounded(units)}, indent=1))
    write(f"cpu_report: written to {out}")

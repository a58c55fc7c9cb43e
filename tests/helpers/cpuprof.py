"""Where the suite's time goes, in CPU as well as wall time: ``python -m pytest -q -n 0 -p tests.helpers.cpuprof``.

Not loaded by default, and only in one stream (``-n 0``: beside the suite's second pytest-xdist worker, each test
would count the other's CPU as its own). Around each test (set-up, call and tear-down) it reads the CPU counters in
``/proc/stat`` (Linux only; elsewhere it records wall time alone), so what a test's ranks, engines, kernels and
browser used counts too, not only this process. At the end it prints the session's busy core-seconds, the tiers
and the slowest tests, and writes every row to ``$CK_CPUPROF`` (default ``cpuprof.json``, ignored by git).

On a shared 2-core machine wall time moves from run to run (the whole suite 1,428 and 1,533 s in two CI runs of the
same tests; ``tests/ranks/test_parity_matrix.py`` 38.5 and 51.7 s in two runs a minute apart), so compare changes
by busy core-seconds as well. Worked example, a test of 4 ranks that
ran 10 s with the two cores 80% busy, and a one-process test that ran 2 s on one core::

    {"test": "tests/ranks/test_x.py::test_four_ranks", "wall": 10.0, "busy": 16.0}
    {"test": "tests/unit/test_y.py::test_one_process", "wall": 2.0, "busy": 2.0}

``busy``: core-seconds the whole machine spent outside its idle loop during the test (at most ``2 * wall`` on 2
cores); ``2 * wall - busy`` is what a second stream could at most have used.
"""
from __future__ import annotations

import json
import os
import time

import pytest

_ROWS: list[dict] = []
_START: dict = {}


def _busy() -> float | None:
    """Core-seconds the machine has spent outside its idle loop since boot, or None where ``/proc/stat`` is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _busy_since(before: float | None) -> float | None:
    after = _busy()
    return None if before is None or after is None else after - before


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, before = time.monotonic(), _busy()
    yield
    _ROWS.append({"test": item.nodeid, "wall": time.monotonic() - t0, "busy": _busy_since(before)})


def pytest_configure(config):
    """Refuse two streams: ``/proc/stat`` counts the whole machine, so beside another worker a test's busy
    core-seconds would be its own and whatever the other worker ran meanwhile."""
    if getattr(config, "workerinput", None) is None and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("tests.helpers.cpuprof measures each test's CPU machine-wide, which pytest-xdist's "
                                "workers would share: run it in one stream, `python -m pytest -q -n 0 -p "
                                "tests.helpers.cpuprof`")


def pytest_sessionstart(session):
    _START.update(t=time.monotonic(), busy=_busy())


def pytest_terminal_summary(terminalreporter):
    wall, busy = time.monotonic() - _START["t"], _busy_since(_START["busy"])
    cores = os.cpu_count() or 1
    write = terminalreporter.write_line
    terminalreporter.section("cpuprof")
    if busy is not None:
        write(f"session: {wall:.0f} s wall, {busy:.0f} busy core-seconds of {cores * wall:.0f} "
              f"({busy / (cores * wall):.0%} of {cores} cores)")
    else:
        write(f"session: {wall:.0f} s wall (no /proc/stat: CPU not measured)")
    tiers: dict[str, list[float]] = {}
    for row in _ROWS:
        tier = row["test"].split("::")[0].rsplit("/", 1)[0]
        acc = tiers.setdefault(tier, [0.0, 0.0])
        acc[0] += row["wall"]
        acc[1] += row["busy"] or 0.0
    for tier, (w, b) in sorted(tiers.items(), key=lambda kv: -kv[1][0]):
        write(f"  {tier:32s} {w:7.0f} s wall {b:7.0f} busy core-s")
    write("slowest tests (wall, busy core-s):")
    for row in sorted(_ROWS, key=lambda r: -r["wall"])[:15]:
        write(f"  {row['wall']:6.1f} {row['busy'] or 0:6.1f}  {row['test']}")
    path = os.environ.get("CK_CPUPROF", "cpuprof.json")
    with open(path, "w") as f:
        json.dump({"wall": wall, "busy": busy, "cores": cores, "tests": _ROWS}, f, indent=0)
    write(f"every test's row: {path}")

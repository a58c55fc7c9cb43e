"""Benchmark results as data: ``bench/results/<name>.json`` from every benchmark, ``docs/benchmarks.md`` rendered
from them and nothing else (``bench/report.py``), so a figure cannot reach the docs without a result file."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("colab_kit_bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)  # bench/report.py, by path: bench/ is not a package
_spec.loader.exec_module(report)

BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_") and p.stem != "report")


def test_every_benchmark_writes_its_result_file():
    for name in BENCHES:
        text = (ROOT / "bench" / f"{name}.py").read_text()
        assert re.search(r"\bwrite\(\s*\"" + name + "\"", text) or ("\"benchmark\": \"" + name + "\"") in text, (
            f"bench/{name}.py does not write bench/results/{name}.json through bench/_results.write")


def _importable_elsewhere(names: list[str]) -> list[str]:
    """The ``names`` that an interpreter started without bench/ on its path imports from somewhere: the stdlib,
    site-packages (``-I``: neither the working directory nor the user's site)."""
    code = ("import importlib.util, json, sys; "
            "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n)]))")
    out = subprocess.run([sys.executable, "-I", "-c", code, *names], capture_output=True, text=True, check=True,
                         cwd=ROOT / "bench")
    return json.loads(out.stdout)


def test_no_benchmark_hides_a_module_of_the_same_name():
    """``python bench/x.py`` puts bench/ first on sys.path, so bench/comm.py was imported in place of Jupyter's
    ``comm`` package and bench/cluster.py's IPython kernel failed (``'comm' is not a package``): no benchmark
    (or helper module) is named after a module of the stdlib or of the installed packages."""
    assert _importable_elsewhere(["comm", "json"]) == ["comm", "json"]  # the check sees a module that is there
    names = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
    assert not _importable_elsewhere(names), "rename these bench/ files: a module of that name is installed"


def test_the_page_is_what_the_results_render():
    """docs/benchmarks.md equals what the committed results render (rerun bench/report.py after a benchmark)."""
    assert (ROOT / "docs" / "benchmarks.md").read_text() == report.render(), (
        "docs/benchmarks.md is not what bench/results/ renders: run python bench/report.py")
    names = {d["benchmark"] for d in report.load()}
    gpu_only = {"gpu_check", "gpu_curves", "gpu_estimate_check", "zero_streams"}  # write only where a GPU is lent
    missing = set(BENCHES) - names - gpu_only
    assert not missing, f"no result file for {sorted(missing)}: run them, then python bench/report.py"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_each_result_says_where_and_how_it_was_measured():
    for data in report.load():
        assert data["command"].startswith(f"python bench/{data['benchmark']}.py"), data["command"]
        assert data["machine"]["cores"] and data["torch"] and data["rows"], data["benchmark"]
        for row in data["rows"]:
            assert set(row) >= {"what", "colab_kit", "peer", "ratio", "note"}, (data["benchmark"], row)
            assert row["ratio"] is None or row["ratio"] > 0, (data["benchmark"], row)


def test_a_result_without_its_keys_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "x", "rows": []}))
    with pytest.raises(ValueError, match="lacks command, when, machine, torch"):
        report.load(str(tmp_path))
    good = {"benchmark": "y", "command": "python bench/y.py", "when": "2026-12-02T05:00:00", "torch": "2.13.0",
            "machine": {"cpu": "c", "cores": 2, "memory_gib": 24.0, "gpu": None},
            "rows": [{"what": "w", "colab_kit": "1.00 ms/step", "peer": "p | q", "ratio": 0.5, "note": ""}]}
    (tmp_path / "x.json").write_text(json.dumps(good))
    page = report.render(str(tmp_path))
    assert "| w | 1.00 ms/step | p \\| q | 0.500 |  |" in page and "run 2026-12-02 05:00:00 on c, 2 cores" in page

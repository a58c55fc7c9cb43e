"""Render ``docs/benchmarks.md`` from ``bench/results/*.json`` (what ``bench/_results.write`` left there).

The page holds no figure of its own: each section is one result file, its command, when and where it ran,
and its rows as the benchmark wrote them. ``tests/unit/test_bench_report.py`` checks that the committed page is
what this renders from the committed results, so a figure cannot reach the docs without a result file.

    python bench/report.py            # rewrite docs/benchmarks.md
    python bench/report.py --check    # exit 1 if docs/benchmarks.md differs from what the results render
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
KEYS = ("benchmark", "command", "when", "machine", "torch", "rows")
ORDER = ("dp", "tp", "one_shot", "pp", "sp", "zero", "zero_scale", "recipe", "models", "moe", "cluster", "ssh", "bind", "spin", "plan", "moe_plan", "gpu_check",
         "gpu_moe_check")

HEAD = """# Benchmarks

Each capability side by side with what a user would pick instead (PyTorch-native, or colab_kit's own other
mode where no outside peer runs), in one run, alternating the contenders so that machine noise hits both.
This page is rendered by `python bench/report.py` from `bench/results/*.json`, which the benchmarks in
`bench/` write; every figure here is in one of those files, with the command that measured it. The ratio is
colab_kit over the peer of what the row names (a time: below 1 is faster); each benchmark's docstring says
how it measures. Rerun one and then `python bench/report.py` to update this page.
"""


def load(results: str = RESULTS) -> list[dict]:
    """Every result file, in the order of ``ORDER`` (others after, by name); a file missing a key is an error."""
    found = []
    for path in glob.glob(os.path.join(results, "*.json")):
        with open(path) as f:
            data = json.load(f)
        missing = [k for k in KEYS if k not in data]
        if missing:
            raise ValueError(f"{os.path.relpath(path, ROOT)} lacks {', '.join(missing)}: write it with "
                             "bench/_results.write (rerun its benchmark)")
        found.append(data)
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found, key=lambda d: (rank.get(d["benchmark"], len(ORDER)), d["benchmark"]))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value).replace("|", "\\|")


def render(results: str = RESULTS) -> str:
    lines = [HEAD]
    for data in load(results):
        m = data["machine"]
        where = f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB" + (
            f", {m['gpu']}" if m.get("gpu") else ", no GPU")
        lines += [f"## {data['benchmark']}", "",
                  f"`{data['command']}`, run {data['when'].replace('T', ' ')} on {where}, torch {data['torch']}.", "",
                  "| what | colab_kit | peer | ratio | note |", "|---|---|---|---|---|"]
        lines += [f"| {_cell(r['what'])} | {_cell(r['colab_kit'])} | {_cell(r['peer'])} | {_cell(r['ratio'])} | "
                  f"{_cell(r.get('note', ''))} |" for r in data["rows"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/benchmarks.md instead of writing it")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        with open(PAGE) as f:
            same = f.read() == page
        print("docs/benchmarks.md is up to date" if same else
              "docs/benchmarks.md differs from what bench/results/ renders: run python bench/report.py")
        return 0 if same else 1
    with open(PAGE, "w") as f:
        f.write(page)
    print(f"wrote {os.path.relpath(PAGE, ROOT)} from {len(load())} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

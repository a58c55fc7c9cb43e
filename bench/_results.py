"""One result file per benchmark: ``bench/results/<name>.json``, the only source of figures in the docs.

Each file holds the machine (CPU, cores, memory, GPU if any), torch's version, when it ran, the exact command,
the arguments, ``rows`` (what ``bench/report.py`` puts in ``docs/benchmarks.md``: one comparison each) and
``figures`` (everything else the run measured, for whoever wants more than the table)::

    {"benchmark": "dp", "command": "python bench/dp.py --rounds 30", "when": "2026-12-02T05:40:11",
     "machine": {"cpu": "...", "cores": 2, "memory_gib": 23.4, "gpu": null, "python": "3.11.7"},
     "torch": "2.13.0+cpu", "args": {...},
     "rows": [{"what": "data parallel, dp=2, ...", "colab_kit": "81.32 ms/step", "peer": "DDP 81.43 ms/step",
               "ratio": 0.996, "note": "median of adjacent-round ratios; goal <= 1.00"}],
     "figures": {...}}

``ratio`` is colab_kit / peer of what the row compares (time: lower is better for colab_kit), or None where a
row states a figure without a peer.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import psutil
        memory = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        memory = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory, "gpu": gpu,
            "python": platform.python_version(), "os": platform.system()}


def row(what: str, colab_kit: str, peer: str | None, ratio: float | None, note: str = "") -> dict:
    return {"what": what, "colab_kit": colab_kit, "peer": peer, "ratio": None if ratio is None else round(ratio, 4),
            "note": note}


def write(name: str, rows: list[dict], figures: dict, args: dict | None = None, argv: list[str] | None = None,
          script: str | None = None) -> str:
    """Write ``bench/results/<name>.json``; return its path. ``script``: the benchmark's file where it is not
    ``bench/<name>.py`` (one script writing two results)."""
    argv = sys.argv[1:] if argv is None else argv
    out = {"benchmark": name, "command": " ".join(["python", f"bench/{script or name}.py", *argv]),
           "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "torch": torch.__version__,
           "args": args or {}, "rows": rows, "figures": figures}
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
        f.write("\n")
    print(f"wrote {path}")
    return path


def gpu_or_smoke(name: str, cpu_smoke: bool, out: str | None) -> tuple[bool, str | None]:
    """Where a GPU-only benchmark runs and writes: ``(cuda, path)``. On CUDA (and not ``cpu_smoke``) the path is
    ``out`` (None: the benchmark's own result file); with ``cpu_smoke`` ``out`` or a temp file, never the GPU's
    results; without CUDA and without ``cpu_smoke`` it says why on stderr and gives ``path`` None (exit 2)."""
    import tempfile
    cuda = torch.cuda.is_available() and not cpu_smoke
    if not cuda and not cpu_smoke:
        print(f"{name}: no CUDA device here. Run it on a GPU machine, or `python bench/{name}.py --cpu-smoke --out "
              f"FILE` to exercise the same code on the CPU.", file=sys.stderr)
        return False, None
    if not cuda and not out:
        fd, out = tempfile.mkstemp(prefix=f"{name}_smoke_", suffix=".json")
        os.close(fd)
    return cuda, out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{name}.json")

"""``ck.dry_run`` forked from a warm server against the same dry run in a new interpreter, side by side in one run.

    python bench/dry_run.py [--rounds 3]

Two dry runs, each timed from the call to its report, ``hardware=[]`` (no pricing):

1. a small GPT (d_model 32, 2 layers) under ``dp=2 x tp=2``, rank 3: what a test or a notebook's quick look costs;
2. notebook 08's 406M GPT (vocab 50304, seq 1024, d_model 1024, 24 layers) under ``dp=8 x tp=8 x pp=8`` (512
   ranks), rank 37, batch 64: the dry run of a large plan.

``ck.dry_run`` forks its child from ``ck.launch``'s forkserver (here: no kernel, so no engine fork server),
which has imported torch and the engine's parts once; the first call of the run starts that server and is
printed, not counted. The peer is what a dry run was before, and what a user would write without a warm
server: a new interpreter (``python -c``) that imports ``colab_kit.planner.dry_runs.child`` and runs the
same pickled jobs (``run_jobs``), its reports read back the same way. The two alternate round by round;
medians and ratios are printed, and the reports are checked equal.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.dry_run)
    from bench._results import row, write

import colab_kit as ck  # noqa: E402
from colab_kit.models import GPT, GPTConfig  # noqa: E402
from colab_kit.planner.dry_runs import run as dry  # noqa: E402

CASES = [("small GPT (d 32 x 2 layers), dp=2 x tp=2, rank 3",
          GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2), ck.ParallelConfig(dp=2, tp=2), 3,
          None),
         ("406M GPT, dp=8 x tp=8 x pp=8 = 512 ranks, rank 37, batch 64",
          GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_heads=16, n_layers=24),
          ck.ParallelConfig(dp=8, tp=8, pp=8, microbatches=8), 37, 64)]


def forked(cfg, config, rank, batch):
    return ck.dry_run(GPT(cfg, device="meta"), config, rank=rank, batch=batch, hardware=[])


def new_interpreter(cfg, config, rank, batch):
    """The same jobs run by ``child.run_jobs`` in ``python -c``, as ``dry_run`` ran them before it forked."""
    import cloudpickle

    jobs = dry._prepare(GPT(cfg, device="meta"), config, rank=rank, batch=batch)
    with tempfile.TemporaryDirectory(prefix="bench-dry-run-") as tmp:
        src, dst = os.path.join(tmp, "jobs.pkl"), os.path.join(tmp, "results.pkl")
        with open(src, "wb") as fh:
            pickle.dump(sys.path, fh)
            cloudpickle.dump(jobs, fh)
        child = "import sys; from colab_kit.planner.dry_runs.child import run_jobs; run_jobs(*sys.argv[1:])"
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", child, src, dst], env=env, check=True, capture_output=True)
        with open(dst, "rb") as fh:
            [report] = pickle.load(fh)
    return dry.with_step_times(report, [])


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    first, _ = timed(forked, *CASES[0][1:])
    print(f"first dry run of the process (starts ck.launch's forkserver): {first:.2f} s")
    rows, figures = [], {"first_call_s": first}
    for what, *case in CASES:
        ours, peer = [], []
        for _ in range(args.rounds):
            t, a = timed(forked, *case)
            ours.append(t)
            t, b = timed(new_interpreter, *case)
            peer.append(t)
            assert a.memory == b.memory and a.n_params == b.n_params, (a, b)
        a, b = statistics.median(ours), statistics.median(peer)
        print(f"{what}: forked {a:.2f} s, new interpreter {b:.2f} s, ratio {a / b:.3f}")
        rows.append(row(f"ck.dry_run of a {what}", f"forked {a:.2f} s", f"a new interpreter {b:.2f} s", a / b,
                        f"medians of {args.rounds} alternating rounds; the reports equal"))
        figures[what] = {"forked_s": ours, "new_interpreter_s": peer}
    write("dry_run", rows, figures, vars(args), argv)


if __name__ == "__main__":
    main()

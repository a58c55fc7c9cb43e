"""Waits that poll for a moment first (``comm.spin``, the default) against waits that sleep at once.

A rank waiting for a CPU collective polls the work for up to ``COLAB_KIT_SPIN_US`` (1000) microseconds, yielding
its core, before it sleeps on it (``colab_kit.comm.spin``). The alternative is what every wait did before, and
what gloo's own ``Work.wait`` does: sleep at once, and be woken by the thread that completes the work. Both sides
run in one spawn per round (the budget is set inside the ranks: ``SPIN_SECONDS``), alternating which goes first:

* the latency of ``dist.all_reduce`` on the ``nccl_rules`` group of every rank (1 and 4,096 float32s, ``--calls``
  calls after 20 warm-up calls; the slowest rank's mean);
* a training step of one config per mode (``planner.local.validate.run_candidates``: 2 warm-up and 2 timed steps
  of a config at a time, the slowest rank's median), whose losses must agree between the sides (same work).

The ratio is polling / sleeping (below 1: polling is faster), the median over ``--rounds`` rounds::

    python bench/spin.py                     # 4 ranks, the demo GPT with 4 layers, batch 16, 5 rounds
    python bench/spin.py --ranks 2 --rounds 5
"""
from __future__ import annotations

import argparse
import statistics

try:
    from _results import row, write
    from bind import CONFIGS, _scaled
except ImportError:  # run as a module (python -m bench.spin)
    from bench._results import row, write
    from bench.bind import CONFIGS, _scaled

SIZES = (1, 4096)


def _sides(budgets: dict, order: list, calls: int, model: dict, configs: list, batch: int, steps: int) -> dict:
    """On each rank: for each side in ``order``, the all-reduce latencies and the configs' steps under its budget."""
    import time

    import torch
    import torch.distributed as dist

    from colab_kit.comm import spin
    from colab_kit.planner.local.validate import run_candidates

    out = {}
    for side in order:
        spin.SPIN_SECONDS = budgets[side]
        lat = {}
        for numel in SIZES:
            t = torch.ones(numel)
            for _ in range(20):
                dist.all_reduce(t)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t)
            lat[numel] = (time.perf_counter() - t0) / calls
        out[side] = {"latency": lat, "runs": run_candidates(model, configs, [{} for _ in configs], batch, steps)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--spin-us", type=float, default=1000.0, help="the polling side's budget (microseconds)")
    args = p.parse_args(argv)

    import dataclasses
    import os

    import colab_kit as ck
    from colab_kit.models import GPTConfig

    model = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=args.layers)
    configs = [_scaled(c, args.ranks) for c in CONFIGS]
    names = [ck.ParallelConfig(**c).describe() + (f", {c['sp_mode']}" if c.get("sp_mode") == "ring" else "")
             for c in configs]
    budgets = {"poll": args.spin_us * 1e-6, "sleep": 0.0}
    lat: dict = {side: {n: [] for n in SIZES} for side in budgets}
    steps: dict = {side: [] for side in budgets}
    losses: dict = {}
    for r in range(args.rounds):
        order = ["poll", "sleep"] if r % 2 == 0 else ["sleep", "poll"]
        res = ck.launch(_sides, args.ranks, budgets, order, args.calls, dataclasses.asdict(model), configs,
                        args.batch, args.steps)
        for side in budgets:
            for n in SIZES:
                lat[side][n].append(max(rank[side]["latency"][n] for rank in res))
            steps[side].append([max(rank[side]["runs"][i]["seconds"] for rank in res) for i in range(len(configs))])
            losses.setdefault(side, [res[0][side]["runs"][i]["losses"] for i in range(len(configs))])
    worst = max(abs(a - b) / abs(b) for i in range(len(configs))
                for a, b in zip(losses["poll"][i], losses["sleep"][i]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{args.ranks} ranks on {cores} cores, nccl_rules, polling budget {args.spin_us:g} us, "
          f"GPT d={model.d_model} x {model.n_layers}, batch {args.batch}, {args.rounds} rounds")
    rows, figures = [], {"configs": configs, "latency_us": {}, "step_ms": {}, "ratio": {}}
    for n in SIZES:
        a, b = [1e6 * x for x in lat["poll"][n]], [1e6 * x for x in lat["sleep"][n]]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        name = f"all_reduce of {n:,} float32"
        print(f"  {name:40} polling {statistics.median(a):7.0f} us   sleeping {statistics.median(b):7.0f} us   "
              f"ratio {ratio:.3f}")
        figures["latency_us"][name] = {"poll": a, "sleep": b}
        figures["ratio"][name] = ratio
        rows.append(row(f"wait polls first, {name} over {args.ranks} ranks (nccl_rules)",
                        f"{statistics.median(a):.0f} us", f"sleeping at once {statistics.median(b):.0f} us", ratio,
                        f"median over {args.rounds} rounds of polling / sleeping, {args.calls} calls each"))
    for i, name in enumerate(names):
        a, b = [1e3 * t[i] for t in steps["poll"]], [1e3 * t[i] for t in steps["sleep"]]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"  {name:40} polling {statistics.median(a):7.2f} ms   sleeping {statistics.median(b):7.2f} ms   "
              f"ratio {ratio:.3f}")
        figures["step_ms"][name] = {"poll": a, "sleep": b}
        figures["ratio"][name] = ratio
        rows.append(row(f"wait polls first, {name}, {args.ranks} ranks, GPT d={model.d_model} x {model.n_layers}, "
                        f"batch {args.batch}", f"{statistics.median(a):.2f} ms/step",
                        f"sleeping at once {statistics.median(b):.2f} ms/step", ratio,
                        f"median over {args.rounds} rounds of polling / sleeping; losses within {worst:.1e}"))
    overall = statistics.geometric_mean(figures["ratio"].values())
    print(f"geometric mean of the ratios {overall:.3f}; losses of the two sides within {worst:.1e} (relative)")
    figures.update(geometric_mean=overall, max_loss_rel_diff=worst, cores=cores)
    write("spin", rows, figures, vars(args), argv)


if __name__ == "__main__":
    main()

"""Ranks bound to their own cores (``launch.bind_rank``, the default) against ranks the OS places.

``ck.launch`` binds local rank r to core ``r % cores`` when ranks outnumber cores (a block of its own cores
otherwise); the alternative a user of ``torchrun`` or ``mp.spawn`` has is the OS's placement, which moves ranks
between cores and at times puts both ends of a collective on one. This boosts the same configs (one per mode)
in a bound spawn and in an unbound one (``COLAB_KIT_BIND=0``), ``--rounds`` times, alternating which goes
first, each training ``--steps`` rounds of every config in turns (``planner.local.validate.run_candidates``: 2
warm-up and 2 timed steps of a config at a time; median step seconds of the slowest rank). Per config the ratio is the median over rounds of bound / unbound
(below 1: binding is faster); the losses of both sides must agree (same work).

    python bench/bind.py                     # 4 ranks, the demo GPT with 4 layers, batch 16, 5 rounds
    python bench/bind.py --ranks 8 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.bind)
    from bench._results import row, write

CONFIGS = [  # one config per mode the engine runs, sized for 4 ranks (ParallelConfig fields; dp fills the rest)
    {"dp": 4},
    {"dp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe"},
    {"pp": 4, "microbatches": 4, "schedule": "1f1b"},
    {"dp": 2, "tp": 2},
    {"dp": 2, "sp": 2, "sp_mode": "ulysses"},
    {"dp": 2, "sp": 2, "sp_mode": "ring"},  # describe() leaves out the default mode: named below
    {"dp": 4, "zero": 3},
]


def _scaled(config: dict, ranks: int) -> dict:
    """``config`` for ``ranks`` ranks: its dp grows (or shrinks) to fill the world."""
    others = 1
    for k in ("tp", "pp", "sp"):
        others *= config.get(k, 1)
    if ranks % others:
        raise SystemExit(f"--ranks {ranks}: config {config} needs a multiple of {others} ranks")
    return {**config, "dp": ranks // others}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    import dataclasses

    import colab_kit as ck
    from colab_kit.launch import cores_for_rank
    from colab_kit.models import GPTConfig
    from colab_kit.planner.local.validate import run_candidates

    model = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=args.layers)
    configs = [_scaled(c, args.ranks) for c in CONFIGS]
    names = [ck.ParallelConfig(**c).describe() + (f", {c['sp_mode']}" if c.get("sp_mode") == "ring" else "")
             for c in configs]
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    before = os.environ.get("COLAB_KIT_BIND")
    times = {"bound": [], "os": []}
    losses = {}
    try:
        for r in range(args.rounds):
            for side in (("bound", "os") if r % 2 == 0 else ("os", "bound")):
                os.environ["COLAB_KIT_BIND"] = "1" if side == "bound" else "0"
                res = ck.launch(run_candidates, args.ranks, dataclasses.asdict(model), configs,
                                [{} for _ in configs], args.batch, args.steps)
                times[side].append([max(rank[i]["seconds"] for rank in res) for i in range(len(configs))])
                losses.setdefault(side, [res[0][i]["losses"] for i in range(len(configs))])
    finally:
        if before is None:
            os.environ.pop("COLAB_KIT_BIND", None)
        else:
            os.environ["COLAB_KIT_BIND"] = before
    worst = max(abs(a - b) / abs(b) for i in range(len(configs))
                for a, b in zip(losses["bound"][i], losses["os"][i]))
    print(f"{args.ranks} ranks on {len(allowed) or os.cpu_count()} cores "
          f"(bound: {[cores_for_rank(r, args.ranks, allowed) for r in range(args.ranks)] if allowed else 'n/a'}), "
          f"GPT d={model.d_model} x {model.n_layers}, batch {args.batch}, {args.rounds} rounds of {args.steps} steps")
    rows, figures = [], {"configs": configs, "ms": {}, "ratio": {}}
    for i, (cfg, name) in enumerate(zip(configs, names)):
        bound = [1e3 * t[i] for t in times["bound"]]
        free = [1e3 * t[i] for t in times["os"]]
        ratio = statistics.median(b / f for b, f in zip(bound, free))
        mb, mf = statistics.median(bound), statistics.median(free)
        print(f"  {name:40} bound {mb:7.2f} ms   OS-placed {mf:7.2f} ms   ratio {ratio:.3f}")
        figures["ms"][name] = {"bound": bound, "os": free}
        figures["ratio"][name] = ratio
        rows.append(row(f"bound ranks, {name}, {args.ranks} ranks, GPT d={model.d_model} x {model.n_layers}, "
                        f"batch {args.batch}", f"{mb:.2f} ms/step", f"OS-placed (COLAB_KIT_BIND=0) {mf:.2f} ms/step",
                        ratio, f"median over {args.rounds} rounds of bound / OS-placed; losses within {worst:.1e}"))
    overall = statistics.geometric_mean(figures["ratio"].values())
    print(f"geometric mean of the ratios {overall:.3f}; losses of the two sides within {worst:.1e} (relative)")
    figures.update(geometric_mean=overall, max_loss_rel_diff=worst, cores=len(allowed) or os.cpu_count())
    write("bind", rows, figures, vars(args), argv)


if __name__ == "__main__":
    main()

"""What playing NCCL's rules costs on CPU: the ``nccl_rules`` backend against plain gloo, the same work.

``nccl_rules`` (``colab_kit.comm.rules``) runs every call on gloo after checking it against NCCL's rules: a
fingerprint of each collective on a shared-memory board, a pair's messages through an ordered channel. It is
the default of ``ck.launch`` and the test suite, so its cost is the suite's: this measures it.

Part 1, one call on 2 ranks: a 4 KiB ``dist.all_reduce`` and a 4 KiB ping-pong (send, then receive the reply),
``--calls`` calls per round. Part 2, training steps on 4 ranks: the 4-block test GPT (d=64, batch 16) under
dp=2 x tp=2, pp=2 x dp=2 (1F1B, 4 microbatches) and ring sp=2 x dp=2; median step time (slowest rank) of
``--steps`` steps after 2 of warm-up. Each part runs ``--rounds`` launches per backend, alternating, and takes
the median over rounds of the rules / gloo ratio. The losses must be the same bits on both backends (the rules
change no sum, only when a call may run).

    python bench/rules.py
    python bench/rules.py --rounds 5 --steps 10
"""
from __future__ import annotations

import argparse
import statistics
import time

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.rules)
    from bench._results import row, write

CONFIGS = {"dp=2 x tp=2": dict(dp=2, tp=2), "pp=2 x dp=2 1f1b": dict(pp=2, dp=2, microbatches=4),
           "ring sp=2 x dp=2": dict(sp=2, dp=2)}


def _calls(calls: int) -> dict:
    import torch
    import torch.distributed as dist

    t, me = torch.zeros(1024), dist.get_rank()
    out = {}
    for name in ("all_reduce", "ping_pong"):
        for _ in range(10):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            if name == "all_reduce":
                dist.all_reduce(t)
            elif me == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        out[name] = (time.perf_counter() - t0) / calls
    return out


def _steps(steps: int, batch: int) -> dict:
    import torch

    import colab_kit as ck
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.models import GPT, GPTConfig

    g = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4)
    data = SyntheticTokens(g.vocab_size, g.seq_len, seed=0)
    out = {}
    for name, kw in CONFIGS.items():
        torch.manual_seed(0)
        engine = ck.boost(GPT(g), lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(**kw))
        losses, times = [], []
        for s in range(steps + 2):
            t0 = time.perf_counter()
            losses.append(engine.train_step(data.batch(s, batch)))
            if s >= 2:
                times.append(time.perf_counter() - t0)
        engine.close()
        out[name] = {"seconds": statistics.median(times), "losses": losses}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)

    import colab_kit as ck

    backends = ("nccl_rules", "gloo")
    calls: dict = {b: [] for b in backends}
    steps: dict = {b: [] for b in backends}
    for r in range(args.rounds):
        for b in (backends if r % 2 == 0 else backends[::-1]):
            per_rank = ck.launch(_calls, 2, args.calls, backend=b)
            calls[b].append({k: max(x[k] for x in per_rank) for k in per_rank[0]})
            per_rank = ck.launch(_steps, 4, args.steps, args.batch, backend=b)
            steps[b].append({k: {"seconds": max(x[k]["seconds"] for x in per_rank), "losses": per_rank[0][k]["losses"]}
                             for k in CONFIGS})
    rows, figures = [], {"calls": calls, "steps": steps}
    for name, what in (("all_reduce", "4 KiB all-reduce, 2 CPU ranks"), ("ping_pong", "4 KiB ping-pong, 2 CPU ranks")):
        ratio = statistics.median(a[name] / b[name] for a, b in zip(calls["nccl_rules"], calls["gloo"]))
        mine = statistics.median(a[name] for a in calls["nccl_rules"])
        theirs = statistics.median(b[name] for b in calls["gloo"])
        rows.append(row(what, f"{mine * 1e6:.0f} us", f"gloo {theirs * 1e6:.0f} us", ratio,
                        f"median of {args.rounds} rounds of {args.calls} calls"))
        print(f"{what:40s} rules {mine * 1e6:7.0f} us   gloo {theirs * 1e6:7.0f} us   ratio {ratio:.2f}")
    same = True
    for name in CONFIGS:
        ratio = statistics.median(a[name]["seconds"] / b[name]["seconds"]
                                  for a, b in zip(steps["nccl_rules"], steps["gloo"]))
        mine = statistics.median(a[name]["seconds"] for a in steps["nccl_rules"])
        theirs = statistics.median(b[name]["seconds"] for b in steps["gloo"])
        bits = all(a[name]["losses"] == b[name]["losses"] for a, b in zip(steps["nccl_rules"], steps["gloo"]))
        same &= bits
        rows.append(row(f"{name} step, GPT d=64 x 4 layers, batch {args.batch}, 4 CPU ranks",
                        f"{mine * 1e3:.2f} ms/step", f"gloo {theirs * 1e3:.2f} ms/step", ratio,
                        f"median of {args.rounds} rounds; losses {'the same bits' if bits else 'DIFFER'}"))
        print(f"{name:40s} rules {mine * 1e3:7.2f} ms   gloo {theirs * 1e3:7.2f} ms   ratio {ratio:.2f}   "
              f"same losses: {bits}")
    if not same:
        raise SystemExit("nccl_rules and gloo trained different losses")
    write("rules", rows, figures, vars(args), argv)


if __name__ == "__main__":
    main()

"""A pair's small all-reduce one-shot (``comm.all_reduce``) against gloo's own ``all_reduce``.

``colab_kit.comm.all_reduce`` sums 2 or more elements up to ``collectives.ONE_SHOT_BYTES`` (64 KiB) over a pair of CPU ranks
in one exchange (an all-gather and a local add); the alternative a user has is what DDP, DTensor and
``dist.all_reduce`` call: gloo's ring, two rounds of half the tensor. Both move the same bytes on 2 ranks.

Part 1, the collective: on 2 ranks, ``comm.all_reduce`` of 16 B, 4 KiB, 64 KiB and 256 KiB (the last past the
threshold: the ring on both sides, a control), ``--calls`` calls a round, the two ways alternating for
``--rounds`` rounds (``ONE_SHOT_BYTES`` set to 0 for the ring); per size the median over rounds of
one-shot / ring.

Part 2, a training step: the 4-block test GPT (d=64, batch 16) under dp=2 x tp=2 on 4 ranks (its tp
all-reduces are 64 KiB, its losses' a number), one engine, the two ways alternating by rounds of 2 warm-up
and 2 timed steps; the median over rounds of one-shot / ring step times (slowest rank), and the losses of
both ways, which must be the same bits (the same sums in the same order on a pair).

    python bench/one_shot.py
    python bench/one_shot.py --rounds 20 --calls 200
"""
from __future__ import annotations

import argparse
import statistics
import time

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.one_shot)
    from bench._results import row, write

SIZES = (16, 4 << 10, 64 << 10, 256 << 10)  # bytes


def _collective(rounds: int, calls: int) -> dict:
    """On each of 2 ranks: {bytes: [(one-shot seconds, ring seconds) per round]} per call."""
    import torch
    import torch.distributed as dist

    import colab_kit as ck
    from colab_kit import comm
    from colab_kit.comm import collectives

    on = collectives.ONE_SHOT_BYTES  # the default; 0 runs the ring
    mesh = ck.ProcessMesh(ck.ParallelConfig(tp=2))
    out = {}
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)  # zeros: a sum of them stays zeros, call after call
        pairs = []
        for r in range(rounds + 1):
            got = {}
            for limit in ((on, 0) if r % 2 == 0 else (0, on)):
                collectives.ONE_SHOT_BYTES = limit
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    comm.all_reduce(t, mesh, "tp", tag="bench")
                got[limit] = (time.perf_counter() - t0) / calls
            mesh.log.records.clear()
            if r:  # the first round warms up
                pairs.append((got[on], got[0]))
        out[nbytes] = pairs
    collectives.ONE_SHOT_BYTES = on
    return out


def _steps(rounds: int, batch: int) -> dict:
    """On each of 4 ranks: per round (one-shot, ring) median step seconds, and each way's losses."""
    import torch

    import colab_kit as ck
    from colab_kit.comm import collectives
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.models import GPT, GPTConfig

    g = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4)
    data = SyntheticTokens(g.vocab_size, g.seq_len, seed=0)
    on = collectives.ONE_SHOT_BYTES  # the default; 0 runs the ring
    engines, losses = {}, {}
    for limit in (on, 0):
        torch.manual_seed(0)
        engines[limit] = ck.boost(GPT(g), lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(dp=2, tp=2))
        losses[limit] = []
    pairs = []
    for r in range(rounds + 1):
        got = {}
        for limit in ((on, 0) if r % 2 == 0 else (0, on)):
            collectives.ONE_SHOT_BYTES = limit
            times = []
            for k in range(4):
                t0 = time.perf_counter()
                losses[limit].append(engines[limit].train_step(data.batch(4 * r + k, batch)))
                if k >= 2:
                    times.append(time.perf_counter() - t0)
            got[limit] = statistics.median(times)
        if r:
            pairs.append((got[on], got[0]))
    collectives.ONE_SHOT_BYTES = on
    for e in engines.values():
        e.close()
    return {"pairs": pairs, "losses": [losses[on], losses[0]]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)

    import colab_kit as ck

    rows, figures = [], {"collective": {}, "step": {}}
    per_rank = ck.launch(_collective, 2, args.rounds, args.calls)
    for nbytes in SIZES:
        # per round, the slower rank's time each way; the ratio of each round, then their median
        pairs = [(max(r[nbytes][i][0] for r in per_rank), max(r[nbytes][i][1] for r in per_rank))
                 for i in range(args.rounds)]
        ratio = statistics.median(a / b for a, b in pairs)
        one, ring = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
        figures["collective"][str(nbytes)] = {"one_shot_s": one, "ring_s": ring, "ratio": ratio, "rounds": pairs}
        past = nbytes > 64 << 10  # collectives.ONE_SHOT_BYTES
        rows.append(row(f"all-reduce of {nbytes:,} B on a pair of CPU ranks" + (" (past the threshold: ring both ways)" if past else ""),
                        f"{one * 1e6:.0f} us", f"gloo all_reduce {ring * 1e6:.0f} us", ratio,
                        f"median of {args.rounds} alternating rounds of {args.calls} calls"))
        print(f"{nbytes:>8,} B   one-shot {one * 1e6:6.0f} us   ring {ring * 1e6:6.0f} us   ratio {ratio:.2f}")
    per_rank = ck.launch(_steps, 4, args.rounds, args.batch)
    pairs = [(max(r["pairs"][i][0] for r in per_rank), max(r["pairs"][i][1] for r in per_rank))
             for i in range(args.rounds)]
    ratio = statistics.median(a / b for a, b in pairs)
    one, ring = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
    same = per_rank[0]["losses"][0] == per_rank[0]["losses"][1]  # one-shot's, the ring's
    figures["step"] = {"one_shot_s": one, "ring_s": ring, "ratio": ratio, "rounds": pairs, "same_losses": same}
    rows.append(row(f"dp=2 x tp=2 step, GPT d=64 x 4 layers, batch {args.batch}, 4 ranks", f"{one * 1e3:.2f} ms/step",
                    f"gloo all_reduce {ring * 1e3:.2f} ms/step", ratio,
                    f"median of {args.rounds} alternating rounds; losses {'the same bits' if same else 'DIFFER'}"))
    print(f"dp=2 x tp=2 step   one-shot {one * 1e3:.2f} ms   ring {ring * 1e3:.2f} ms   ratio {ratio:.2f}; "
          f"losses the same bits: {same}")
    if not same:
        raise SystemExit("the one-shot and the ring trained different losses")
    write("one_shot", rows, figures, vars(args), argv)


if __name__ == "__main__":
    main()

"""Pipeline parallelism: measured bubbles against theory, and colab_kit 1F1B against
``torch.distributed.pipelining.Schedule1F1B`` side by side in one run.

Part 1 trains the same GPT with every schedule on ``--pp`` ranks and reads each
rank's executed actions from ``engine.timeline()``: the measured bubble is
``1 - compute time / (ranks x span)`` (``colab_kit.viz.schedule_data.measured_bubble``,
the definition the notebook and ``%colossal timeline`` use; waiting in a receive is idle). Beside it, the plan's simulated bubble (unit
costs F=1, B=2, I=W=1) and each schedule's own textbook formula
(``colab_kit.pipeline.simulate.theory_bubble``: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1).

Part 2 runs colab_kit's 1F1B and PyTorch's Schedule1F1B on the same two stages (the
stages colab_kit cuts, wrapped in torch's PipelineStage), alternating in rounds, and
prints the median step times and their ratio (target <= 1.10), and checks that the two
trained to the same losses (they start from the same weights and see the same batches).

    python bench/pp.py
    python bench/pp.py --pp 4          (the GPT gets 2 * pp layers, so interleaving's 2 chunks fit)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine import lm_loss
from colab_kit.models import GPT, GPTConfig
from colab_kit.pipeline import build_plan, lower, simulate
from colab_kit.pipeline.simulate import theory_bubble
from colab_kit.viz.schedule_data import measured_bubble


def _schedules(gpt_kwargs, batch, microbatches, steps):
    out = {}
    data = SyntheticTokens(gpt_kwargs["vocab_size"], gpt_kwargs["seq_len"], seed=0)
    pp = torch.distributed.get_world_size()
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        cfg = ck.ParallelConfig(pp=pp, microbatches=microbatches, schedule=schedule, chunks=chunks)
        engine = ck.boost(GPT(GPTConfig(**gpt_kwargs)), lambda ps: torch.optim.SGD(ps, lr=0.05), cfg)
        out[schedule] = []
        for s in range(steps):
            engine.train_step(data.batch(s, batch))
            if s:  # the first step warms up
                out[schedule].append(engine.timeline())
    return out


def _versus_torch(gpt_kwargs, batch, microbatches, rounds, steps):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from colab_kit.pipeline.stage import split_model

    pp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    gcfg = GPTConfig(**gpt_kwargs)
    cfg = ck.ParallelConfig(pp=pp, microbatches=microbatches, schedule="1f1b")
    engine = ck.boost(GPT(gcfg), lambda ps: torch.optim.SGD(ps, lr=0.05), cfg)
    (stage,) = split_model(GPT(gcfg), cfg, rank)
    torch_stage = PipelineStage(stage, rank, pp, torch.device("cpu"))
    schedule = Schedule1F1B(torch_stage, microbatches, loss_fn=lm_loss)
    opt = torch.optim.SGD(stage.parameters(), lr=0.05)
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0)

    def torch_step(s):
        x, y = data.batch(s, batch)
        opt.zero_grad()
        losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == pp - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else None  # the mean over microbatches

    runners = {"colab_kit": lambda s: engine.train_step(data.batch(s, batch)), "torch": torch_step}
    times, losses = {k: [] for k in runners}, {k: {} for k in runners}
    for r in range(rounds + 1):
        for name in (("colab_kit", "torch") if r % 2 == 0 else ("torch", "colab_kit")):
            torch.distributed.barrier()
            for s in range(steps):
                t0 = time.perf_counter()
                losses[name][r * steps + s] = runners[name](r * steps + s)
                torch.distributed.barrier()  # a step ends when every stage is done
                if r:
                    times[name].append(time.perf_counter() - t0)
    return times, losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="default: 2 * pp (interleaving needs pp * 2 | layers)")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    layers = args.layers or max(4, 2 * args.pp)
    gpt = dict(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=layers)
    p, m = args.pp, args.microbatches
    measured = ck.launch(_schedules, p, gpt, args.batch, m, args.steps)
    print(f"GPT {gpt}, global batch {args.batch}, pp={p}, microbatches={m}")
    print(f"{'schedule':12} {'measured bubble':>16} {'planned (simulated)':>20} {'its textbook formula':>21}")
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        planned = simulate(lower(build_plan(schedule, p, m, chunks))).bubble_fraction
        got = statistics.median(measured_bubble([rank[schedule][i] for rank in measured])
                                for i in range(args.steps - 1))
        print(f"{schedule:12} {got:>16.3f} {planned:>20.3f} {theory_bubble(schedule, p, m, chunks):>21.3f}")
    gpt2 = dict(gpt, n_layers=args.layers or 4)  # the side-by-side runs on 2 ranks
    results = ck.launch(_versus_torch, 2, gpt2, args.batch, m, args.rounds, args.steps)
    times, losses = results[0][0], results[-1][1]  # torch reports its loss on the last stage
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\npp=2, 1F1B, microbatches={m}, {gpt2['n_layers']} layers: median step time   colab_kit {med['colab_kit']:.2f} ms   "
          f"torch.distributed.pipelining {med['torch']:.2f} ms   ratio {med['colab_kit'] / med['torch']:.3f} "
          f"(target <= 1.10)")
    worst = max(abs(losses["colab_kit"][k] - losses["torch"][k]) / abs(losses["torch"][k]) for k in losses["torch"])
    print(f"max relative loss difference colab_kit vs torch over {len(losses['torch'])} steps: {worst:.2e}")


if __name__ == "__main__":
    main()

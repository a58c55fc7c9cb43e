"""Pipeline parallelism: step times and bubbles per schedule, and colab_kit against
``torch.distributed.pipelining`` on the same stages and the same action lists, in one run.

Part 1 trains the same GPT with every schedule on ``--pp`` ranks, the schedules taking
turns in rounds (so load on the machine falls on all of them alike), and prints per
schedule the median step time and its ratio to 1F1B (the metric that cannot reward extra
work: a schedule that redoes part of a backward is slower, whatever its bubble says),
the measured bubble ``1 - compute time / (ranks x span)`` from ``engine.timeline()``
(``colab_kit.viz.schedule_data.measured_bubble``; waiting in a receive is idle), the plan's
simulated bubble (the plan the engine runs, simulated with unit costs F=1, B=2, I=W=1) and
the schedule's own textbook formula
(``colab_kit.pipeline.simulate.theory_bubble``: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1, (p-1)/(6m+p-1) ZB-V). The row ``zb-v``
runs the engine's default ZB-V plan, list-scheduled on the stages' FLOPs (``costs.flop_costs``:
known before any step runs). The row ``zb-v fitted`` is ZB-V re-scheduled from its own costs:
each stage's F, I and W measured in the timelines of warm-up steps 2-4
(``costs.measured_costs``, medians, the slowest rank's), then ``engine.pipeline.replan(costs)``
list-schedules the V on them (``colab_kit.pipeline.costs``), keeping the FLOP plan where that
simulates shorter under them. The run prints those costs and the simulated makespans under them
of the unit-step plan, the FLOP plan and the fitted plan, and which one replan() kept.

Part 2 runs, on 2 ranks, the stages colab_kit cuts wrapped in torch's ``PipelineStage``:
colab_kit 1F1B against torch's ``Schedule1F1B``, and colab_kit ZB-H1 against torch's
``_PipelineScheduleRuntime`` executing colab_kit's own ZB-H1 action lists (the same F, I,
W order; torch adds its sends and receives). Each pair alternates in rounds; it prints
median step times, their ratio (target <= 1.10) and the largest loss difference (they
start from the same weights and see the same batches).

    python bench/pp.py
    python bench/pp.py --pp 4          (the GPT gets 4 * pp layers: two blocks per stage of interleaved and zb-v)
    python bench/pp.py --layers 4      (one block per stage: the V's rank 0, which holds the embeddings and the
                                        head beside two blocks, then carries a larger share and ZB-V only ties 1F1B)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.core import lm_loss
from colab_kit.models import GPT, GPTConfig
from colab_kit.pipeline import build_plan, build_plan_for, lower, simulate

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.pp)
    from bench._results import row, write
from colab_kit.pipeline.actions import parse
from colab_kit.pipeline.costs import measured_costs, shorter_plan
from colab_kit.pipeline.simulate import theory_bubble
from colab_kit.viz.schedule_data import measured_bubble

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))
FITTED = "zb-v fitted"
"""ZB-V list-scheduled from its own measured costs (``engine.pipeline.replan()`` after one step)."""


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05)


def _rounds(runners: dict, rounds: int, steps: int, after=None):
    """Run each runner for ``steps`` steps per round, the order rotating; time every step after round 0."""
    names, times, losses = list(runners), {k: [] for k in runners}, {k: {} for k in runners}
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.distributed.barrier()
            for s in range(steps):
                t0 = time.perf_counter()
                losses[name][r * steps + s] = runners[name](r * steps + s)
                torch.distributed.barrier()  # a step ends when every stage is done
                if r:
                    times[name].append(time.perf_counter() - t0)
                    if after is not None:
                        after(name)
    return times, losses


def _schedules(gpt_kwargs, batch, microbatches, rounds, steps):
    data = SyntheticTokens(gpt_kwargs["vocab_size"], gpt_kwargs["seq_len"], seed=0)
    pp = torch.distributed.get_world_size()
    engines = {s: ck.boost(GPT(GPTConfig(**gpt_kwargs)), _sgd, ck.ParallelConfig(
        pp=pp, microbatches=microbatches, schedule=s, chunks=c)) for s, c in SCHEDULES}
    engines[FITTED] = ck.boost(GPT(GPTConfig(**gpt_kwargs)), _sgd, ck.ParallelConfig(
        pp=pp, microbatches=microbatches, schedule="zb-v", chunks=2))
    warm = []
    for i in range(4):  # warm-up steps; the costs are the medians over the last three (one step is noisy under load)
        engines[FITTED].train_step(data.batch(i, batch))
        warm += engines[FITTED].timeline() if i else []
    costs = engines[FITTED].pipeline.replan(measured_costs(warm, range(2 * pp)))
    timelines = {s: [] for s in engines}
    runners = {s: (lambda i, e=e: e.train_step(data.batch(i, batch))) for s, e in engines.items()}
    times, _ = _rounds(runners, rounds, steps, after=lambda s: timelines[s].append(engines[s].timeline()))
    for e in engines.values():
        e.close()
    return times, timelines, costs


def _versus_torch(gpt_kwargs, batch, microbatches, rounds, steps):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    from colab_kit.pipeline.stage import split_model

    pp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    gcfg = GPTConfig(**gpt_kwargs)
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0)
    kinds = {"F": _ComputationType.FORWARD, "I": _ComputationType.BACKWARD_INPUT,
             "W": _ComputationType.BACKWARD_WEIGHT, "B": _ComputationType.FULL_BACKWARD}
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        cfg = ck.ParallelConfig(pp=pp, microbatches=microbatches, schedule=schedule)
        engine = ck.boost(GPT(gcfg), _sgd, cfg)
        (stage,) = split_model(GPT(gcfg), cfg, rank)
        torch_stage = PipelineStage(stage, rank, pp, torch.device("cpu"))
        if schedule == "1f1b":
            runtime = Schedule1F1B(torch_stage, microbatches, loss_fn=lm_loss)
        else:  # torch's runtime executing colab_kit's own ZB-H1 compute actions
            runtime = _PipelineScheduleRuntime([torch_stage], microbatches, loss_fn=lm_loss)
            plan = build_plan(schedule, pp, microbatches)
            runtime._prepare_schedule_with_comms(
                {r: [_Action(a.stage, kinds[a.kind], a.microbatch) for a in plan.actions[r]] for r in range(pp)})
        opt = _sgd(stage.parameters())

        def torch_step(s, runtime=runtime, opt=opt):
            x, y = data.batch(s, batch)
            opt.zero_grad()
            losses = []
            if rank == 0:
                runtime.step(x)
            elif rank == pp - 1:
                runtime.step(target=y, losses=losses)
            else:
                runtime.step()
            opt.step()
            return float(torch.stack(losses).detach().mean()) if losses else None  # the mean over microbatches

        runners = {"colab_kit": lambda s, e=engine: e.train_step(data.batch(s, batch)), "torch": torch_step}
        out[schedule] = _rounds(runners, rounds, steps)
        engine.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="default: 4 * pp, two blocks per stage of interleaved and zb-v (they need pp * 2 | layers)")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    layers = args.layers or 4 * args.pp  # two blocks per stage of the 2-chunk schedules
    gpt = dict(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=layers)
    p, m = args.pp, args.microbatches
    results = ck.launch(_schedules, p, gpt, args.batch, m, args.rounds, args.steps)
    times, costs = results[0][0], results[0][2]
    med = {s: statistics.median(v) * 1e3 for s, v in times.items()}
    n = len(times["1f1b"])
    print(f"GPT {gpt}, global batch {args.batch}, pp={p}, microbatches={m}, {args.rounds} rounds x {args.steps} "
          f"steps timed per schedule")
    print(f"{'schedule':12} {'step ms':>8} {'vs 1f1b':>8} {'measured bubble':>16} {'planned (simulated)':>20} "
          f"{'its textbook formula':>21}")
    rows, figures = [], {"median_ms": med, "schedules": {}}
    flops = build_plan_for(ck.ParallelConfig(pp=p, microbatches=m, schedule="zb-v", chunks=2),
                           GPTConfig(**gpt))  # the engine's first V, on the stages' FLOPs
    fitted = build_plan("zb-v", p, m, 2, costs=costs)
    installed = shorter_plan(fitted, flops, costs)  # what replan() kept
    for schedule, chunks in SCHEDULES + ((FITTED, 2),):
        plan = installed if schedule == FITTED else build_plan_for(
            ck.ParallelConfig(pp=p, microbatches=m, schedule=schedule, chunks=chunks), GPTConfig(**gpt))  # the engine's
        planned = simulate(lower(plan)).bubble_fraction
        got = statistics.median(measured_bubble([rank[1][schedule][i] for rank in results]) for i in range(n))
        print(f"{schedule:12} {med[schedule]:>8.2f} {med[schedule] / med['1f1b']:>8.3f} {got:>16.3f} "
              f"{planned:>20.3f} {theory_bubble(schedule.split()[0], p, m, chunks):>21.3f}")
        figures["schedules"][schedule] = {"ms": med[schedule], "vs_1f1b": med[schedule] / med["1f1b"],
                                          "bubble_measured": got, "bubble_planned": planned}
        if schedule != "1f1b":
            rows.append(row(f"pipeline {schedule}, pp={p}, {m} microbatches, GPT d={args.d_model} x {layers}, "
                            f"batch {args.batch}", f"{med[schedule]:.2f} ms/step",
                            f"colab_kit 1F1B {med['1f1b']:.2f} ms/step", med[schedule] / med["1f1b"],
                            f"ratio of medians; measured bubble {got:.3f}, planned {planned:.3f}"))
    unit = build_plan("zb-v", p, m, 2)
    print("zb-v fitted: costs measured in warm-up steps 2-4 (ms, the slowest rank): " + ", ".join(
        f"{s}{k} {v * 1e3:.2f}" for (s, k), v in costs.items()) + f"; with these costs and free messages the "
        f"unit-step plan takes {simulate(unit, costs).makespan * 1e3:.1f} ms, the engine's default (on the "
        f"stages' FLOPs) {simulate(flops, costs).makespan * 1e3:.1f} ms, the fitted one "
        f"{simulate(fitted, costs).makespan * 1e3:.1f} ms (busiest rank's work "
        f"{max(simulate(fitted, costs).busy) * 1e3:.1f} ms); replan() kept "
        f"{'the fitted one' if installed is fitted else 'the FLOP plan (it simulates shorter)'}")
    v = build_plan("zb-v", p, m, 2)
    print("zb-v work per microbatch by rank (F + I + W of its two stages, from those costs): " + ", ".join(
        f"rank {r} {sum(costs[s, k] for s in v.stages_of(r) for k in 'FIW') * 1e3:.2f} ms" for r in range(p)))
    last = results[-1][1]  # the last pipeline rank's timelines: its compute per step, by action kind

    def per_step(schedule, kinds):
        return sum(e["end"] - e["start"] for tl in last[schedule] for e in tl
                   if e.get("action") and parse(e["action"]).kind in kinds) / n * 1e3
    def busy(schedule, r):  # rank r's compute per step, ms
        return sum(e["end"] - e["start"] for tl in results[r][1][schedule] for e in tl
                   if e.get("action") and e.get("kind") == "compute") / n * 1e3
    def between(schedule, r):  # rank r's time per step outside any action (executor overhead), ms
        gaps = 0.0
        for tl in results[r][1][schedule]:
            acts = [e for e in tl if e.get("action")]
            gaps += sum(b["start"] - a["end"] for a, b in zip(acts, acts[1:]))
        return gaps / n * 1e3
    print("compute per step by rank (ms): " + "; ".join(
        f"{s} " + " ".join(f"{busy(s, r):.1f}" for r in range(p)) for s in ("1f1b", "zb-h1", "zb-v", FITTED)))
    print("time between actions per step by rank (ms): " + "; ".join(
        f"{s} " + " ".join(f"{between(s, r):.1f}" for r in range(p)) for s in ("1f1b", "zb-h1", "zb-v", FITTED)))
    b, i, w = per_step('1f1b', ('B',)), per_step('zb-h1', ('I',)), per_step('zb-h1', ('W',))
    print(f"last rank's compute per step: 1f1b B {b:.1f} ms; zb-h1 I {i:.1f} + W {w:.1f} ms = {(i + w) / b:.3f} of B "
          f"(the split's cost: I + W against B)")
    gpt2 = dict(gpt, n_layers=args.layers or 8)  # the side-by-side runs on 2 ranks
    # on gloo itself, as torch.distributed.pipelining's users on CPU run it (both sides on one backend); it also
    # trains under nccl_rules, which takes torch's batch_isend_irecv as one NCCL group (docs/nccl.md)
    pairs = ck.launch(_versus_torch, 2, gpt2, args.batch, m, args.rounds, args.steps, backend="gloo")
    versus = []
    for schedule, torch_name in (("1f1b", "Schedule1F1B"), ("zb-h1", "_PipelineScheduleRuntime, same actions")):
        times, losses = pairs[0][schedule][0], pairs[-1][schedule][1]  # torch reports its loss on the last stage
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        worst = max(abs(losses["colab_kit"][k] - losses["torch"][k]) / abs(losses["torch"][k]) for k in losses["torch"])
        print(f"\npp=2, {schedule}, microbatches={m}, {gpt2['n_layers']} layers: median step time   colab_kit "
              f"{med['colab_kit']:.2f} ms   torch ({torch_name}) {med['torch']:.2f} ms   ratio "
              f"{med['colab_kit'] / med['torch']:.3f} (target <= 1.10); max relative loss difference over "
              f"{len(losses['torch'])} steps: {worst:.2e}")
        versus.append(row(
            f"pipeline {schedule}, pp=2, {m} microbatches, GPT d={args.d_model} x {gpt2['n_layers']}, batch {args.batch}",
            f"{med['colab_kit']:.2f} ms/step", f"torch.distributed.pipelining {torch_name} {med['torch']:.2f} ms/step",
            med["colab_kit"] / med["torch"], f"ratio of medians (goal <= 1.10); losses within {worst:.1e}"))
        figures[f"versus_torch_{schedule}"] = {"median_ms": med, "max_loss_rel_diff": worst}
    write("pp", versus + rows, figures, vars(args), argv)


if __name__ == "__main__":
    main()

"""Sequence parallelism: the longest sequence each mode trains under one memory budget, and its speed.

Part 1 (the paper's claim: ring self-attention reaches 3.0x the sequence length of tensor
parallelism on the same devices). For ring sp=4, ulysses sp=4, split_gather tp=4, tp=4 (1d)
and one process, a GPT (d=64, 4 heads, 2 layers, batch 2) trains one step at t = 128, 256, ...
(steps of --step) up to --max-t. What a rank holds at its peak is measured by the dispatch-level
meter (``ck.memory_timeline(engine, batch)``: every live storage after every op of the step, model states,
saved activations, temporaries such as the attention's scores, and the collectives' buffers). The
longest t whose peak stays under --budget (bytes per rank) is printed per mode, with its ratio to tp=4.

Part 2: tokens per second at one length (--t, default 512), each mode in rounds that
alternate, median step time over rounds. The 4-rank modes run 4 processes: on a machine with
fewer cores than ranks they share cores (the output says so), the one-process row does not.

Part 3, peers: none is run. The comparison is colab_kit's sequence modes against colab_kit's tp=4
(1d) and one process, and the results say so. DeepSpeed's ``DistributedAttention`` (Ulysses) is not
compared (deepspeed is not a dependency); PyTorch's ring attention is reached through
``context_parallel``, which does not run on CPU tensors in torch 2.13. Writes ``bench/results/sp.json``.

    python bench/sp.py                          # budget 8 MiB per rank, t up to 3072 in steps of 128
    python bench/sp.py --budget 8388608 --max-t 4096 --t 1024 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.sp)
    from bench._results import row, write

MODES = {  # name -> (ranks, config)
    "ring sp=4": (4, dict(sp=4)),
    "ulysses sp=4": (4, dict(sp=4, sp_mode="ulysses")),
    "split_gather tp=4": (4, dict(tp=4, sp_mode="split_gather")),
    "tp=4 (1d)": (4, dict(tp=4)),
    "one process": (1, dict()),
}


def _model(t: int) -> GPTConfig:
    return GPTConfig(vocab_size=128, seq_len=t, d_model=64, n_heads=4, n_layers=2)


def _peaks(kw: dict, lengths: list[int], batch: int, budget: int):
    """Peak bytes per rank (model states + activations) after one step at each length, until over the budget."""
    out = {}
    for t in lengths:
        try:
            engine = ck.boost(GPT(_model(t)), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(**kw))
        except ck.ConfigError as exc:
            return {"refused": str(exc)}
        # every storage alive after every op of the step (the dispatch-level meter): model states, what autograd
        # saved, the attention's temporaries and the collectives' buffers, not the saved tensors alone
        timeline = ck.memory_timeline(engine, SyntheticTokens(128, t, seed=0).batch(0, batch))
        engine.close()
        peak = torch.tensor([timeline.peak])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)  # the fullest rank
        out[t] = int(peak)
        if out[t] > budget:
            break
    return out


def _speed(kw: dict, t: int, batch: int, steps: int):
    """Seconds per step, ``steps`` steps after a warm-up one (the engine stays for the next round)."""
    engine = ck.boost(GPT(_model(t)), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(**kw))
    data = SyntheticTokens(128, t, seed=0)
    engine.train_step(data.batch(0, batch))
    t0 = time.perf_counter()
    for s in range(steps):
        engine.train_step(data.batch(s + 1, batch))
    engine.close()
    return (time.perf_counter() - t0) / steps


def _peers() -> list[str]:
    lines = []
    try:
        import deepspeed  # noqa: F401
        lines.append("DeepSpeed DistributedAttention: installed, but its CPU accelerator comparison is not wired "
                     "into this bench yet")
    except ImportError:
        lines.append("DeepSpeed DistributedAttention: not installed (pip install deepspeed to compare Ulysses)")
    if torch.cuda.is_available():
        lines.append("torch context_parallel (ring): a GPU is present, but this bench compares on CPU ranks only")
    else:
        lines.append("torch context_parallel (ring): not run: it does not run on CPU tensors in torch 2.13")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=8 << 20, help="bytes per rank (default 8 MiB)")
    p.add_argument("--max-t", type=int, default=3072)
    p.add_argument("--step", type=int, default=128, help="lengths tried: step, 2 step, ... up to --max-t")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--t", type=int, default=512, help="length of part 2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    lengths = list(range(args.step, args.max_t + 1, args.step))
    print(f"part 1: longest sequence under {args.budget:,} B per rank (model states + activations, measured), "
          f"GPT d=64 x 2 layers, batch {args.batch}")
    longest = {}
    for name, (ranks, kw) in MODES.items():
        res = ck.launch(_peaks, ranks, kw, lengths, args.batch, args.budget, timeout=1800)[0]
        if "refused" in res:
            print(f"  {name:18} not runnable: {res['refused'][:150]}")
            continue
        fits = [t for t, b in res.items() if b <= args.budget]
        longest[name] = max(fits) if fits else 0
        tail = " (the largest t tried: it may fit longer)" if longest[name] == max(lengths) else ""
        shown = list(res.items())[-3:]  # the last lengths tried: the edge of the budget
        print(f"  {name:18} ... " + "  ".join(f"t={t}: {b / 2**20:.2f} MiB" for t, b in shown)
              + f"   -> longest {longest[name]}{tail}")
    base = longest.get("tp=4 (1d)")
    if base:
        for name, t in longest.items():
            print(f"  {name:18} longest t {t:6d}   x{t / base:.2f} of tp=4")
    cores = os.cpu_count() or 1
    shared = f" ({cores} CPU cores: the 4-rank modes share them)" if cores < 4 else ""
    print(f"\npart 2: tokens per second at t={args.t}, batch {args.batch}, median of {args.rounds} rounds of "
          f"{args.steps} steps{shared}")
    times = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name, (ranks, kw) in MODES.items():
            try:
                times[name].append(ck.launch(_speed, ranks, kw, args.t, args.batch, args.steps, timeout=1800)[0])
            except ck.errors.RankError as exc:
                times[name] = None
                print(f"  {name:18} not runnable: {str(exc).splitlines()[0][:150]}")
                break
    ref = statistics.median(times["tp=4 (1d)"]) if times.get("tp=4 (1d)") else None
    for name, ts in times.items():
        if ts:
            med = statistics.median(ts)
            ratio = f"   {ref / med:.2f}x the tokens/s of tp=4" if ref else ""
            print(f"  {name:18} {med * 1e3:9.1f} ms/step   {args.batch * args.t / med:9.0f} tokens/s{ratio}")
    print("\npart 3: peers")
    for line in _peers():
        print("  " + line)
    rows = []
    if base:
        rows.append(row(f"sequence parallelism: longest sequence under {args.budget / 2**20:g} MiB per rank (the "
                        f"dispatch-level peak), GPT d=64 x 2, batch {args.batch}, 4 ranks",
                        ", ".join(f"{n}: {t}" for n, t in longest.items() if n not in ("tp=4 (1d)", "one process")),
                        f"colab_kit tp=4 (1d): {base}; one process: {longest.get('one process')} (no external peer "
                        f"run)", longest.get("ring sp=4", 0) / base,
                        "ratio: ring's length over tp=4's (the paper reports 3.0x on its models)"))
    med = {n: statistics.median(ts) for n, ts in times.items() if ts}
    if ref:
        rows.append(row(f"sequence parallelism: tokens/s at t={args.t}, same model, 4 ranks on {cores} cores",
                        ", ".join(f"{n} {args.batch * args.t / m:,.0f}" for n, m in med.items() if n != "tp=4 (1d)"),
                        f"colab_kit tp=4 (1d) {args.batch * args.t / ref:,.0f} (no external peer run)",
                        med["ring sp=4"] / ref if "ring sp=4" in med else None,
                        "ratio: ring's step time over tp=4's"))
    write("sp", rows, {"longest": longest, "median_s": med, "peers": _peers()}, vars(args), argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

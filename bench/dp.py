"""Data parallelism: colab_kit dp=2 against torch DDP, side by side in one run.

Both train the same GPT on the same batches on the same two local ranks; the
runs alternate in rounds so that machine noise hits both alike. Prints the
median step time of each, their ratio (colab_kit / DDP; target <= 1.10), and
the bytes colab_kit all-reduced per step against the parameter bytes.

    python bench/dp.py                  # defaults: 2 ranks, 8 rounds of 10 steps
    python bench/dp.py --rounds 4 --steps 5 --d-model 64
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


def _rounds(gpt_kwargs: dict, batch: int, rounds: int, steps: int, bucket_mb: float | None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = torch.distributed
    cfg = ck.ParallelConfig(dp=dist.get_world_size())
    gcfg = GPTConfig(**gpt_kwargs)
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0)
    adam = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    engine = ck.boost(GPT(gcfg), adam, cfg)
    ddp_kwargs = {"bucket_cap_mb": bucket_mb} if bucket_mb else {}
    ddp = DDP(GPT(gcfg), **ddp_kwargs)
    ddp_opt = adam(ddp.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = batch // world

    def ddp_step(step):
        x, y = data.batch(step, batch)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        ddp_opt.zero_grad()
        loss = lm_loss(ddp(x), y)
        loss.backward()
        ddp_opt.step()
        loss = loss.detach()
        dist.all_reduce(loss)  # report the global loss, as the engine does
        return loss.item() / world

    times = {"colab_kit": [], "ddp": []}
    losses = {"colab_kit": [], "ddp": []}
    runners = {"colab_kit": lambda s: engine.train_step(data.batch(s, batch)), "ddp": ddp_step}
    for r in range(rounds + 1):  # round 0 warms up both
        for name in (("colab_kit", "ddp") if r % 2 == 0 else ("ddp", "colab_kit")):
            dist.barrier()
            for s in range(steps):
                t0 = time.perf_counter()
                loss = runners[name](r * steps + s)
                if r:
                    times[name].append(time.perf_counter() - t0)
                    losses[name].append(loss)
    return {"times": times, "losses": losses, "comm": engine.comm(last_step=True),
            "param_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
            "buckets": len(engine.grads.buckets)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's own)")
    args = ap.parse_args(argv)
    gpt = dict(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    res = ck.launch(_rounds, args.ranks, gpt, args.batch, args.rounds, args.steps, args.bucket_mb)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
    grad_bytes = sum(r["bytes"] for r in res["comm"] if r["tag"].startswith("grad"))
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["colab_kit"], res["losses"]["ddp"]))
    print(f"GPT {gpt}, global batch {args.batch}, {args.ranks} ranks, {args.rounds} rounds x {args.steps} steps, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads in the parent")
    print(f"median step time   colab_kit {med['colab_kit']:.2f} ms   torch DDP {med['ddp']:.2f} ms   "
          f"ratio {med['colab_kit'] / med['ddp']:.3f} (target <= 1.10)")
    print(f"gradient bytes all-reduced per step {grad_bytes:,} in {res['buckets']} buckets; parameter bytes "
          f"{res['param_bytes']:,} (ratio {grad_bytes / res['param_bytes']:.3f}); plus "
          f"{sum(r['bytes'] for r in res['comm']) - grad_bytes} B for the loss")
    print(f"max relative loss difference colab_kit vs DDP over the timed steps: {worst:.2e}")


if __name__ == "__main__":
    main()

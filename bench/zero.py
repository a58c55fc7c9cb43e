"""ZeRO-2: colab_kit ``zero=2`` against FSDP2 ``fully_shard(reshard_after_forward=False)``, side by side.

FSDP2 that keeps its parameters gathered between forward and backward is PyTorch's
ZeRO-2: gradients reduce-scattered, each rank stepping its shard of the optimizer
states. Both sides train the same GPT (same seed) on the same batches, on the same
local ranks, with AdamW, and each step is timed whole (forward, backward, gradient
reduction, optimizer step, parameter gather, the global loss). The runs alternate
in short rounds, ABBA, so that machine noise hits both alike; the headline is the
median over rounds of the ratio of adjacent rounds, beside the ratio of the overall
medians. Target: <= 1.00.

It also prints what each rank holds after a step: optimizer-state bytes (target:
at most FSDP2's), gradient bytes and parameter bytes, and checks that both sides
made the same updates (losses step by step).

    python bench/zero.py                  # 2 ranks, 20 rounds of 3 steps
    python bench/zero.py --ranks 4 --rounds 10 --d-model 64
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


def _local_bytes(tensors) -> int:
    """Bytes of this rank's local pieces (a DTensor's ``to_local()``, a plain tensor as it is)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def _fsdp2(gcfg: GPTConfig, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = GPT(gcfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:  # one communication unit per block, and the rest at the root
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _rounds(gpt_kwargs: dict, batch: int, rounds: int, steps: int):
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    gcfg = GPTConfig(**gpt_kwargs)
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0)
    adam = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    engine = ck.boost(GPT(gcfg), adam, ck.ParallelConfig(dp=world, zero=2))
    fsdp = _fsdp2(gcfg, world)
    fsdp_opt = adam(fsdp.parameters())
    rows = batch // world

    def fsdp_step(step):
        x, y = data.batch(step, batch)
        loss = lm_loss(fsdp(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
        loss.backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad(set_to_none=False)  # keep the gradient shards, as colab_kit keeps its pieces
        loss = loss.detach()
        dist.all_reduce(loss)
        return loss.item() / world

    names = ("colab_kit", "fsdp2")
    runners = {"colab_kit": lambda s: engine.train_step(data.batch(s, batch)), "fsdp2": fsdp_step}
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    per_round = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms up both
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            mine = []
            for s in range(steps):
                t0 = time.perf_counter()
                loss = runners[name](r * steps + s)
                if r:
                    mine.append(time.perf_counter() - t0)
                    losses[name].append(loss)
            if r:
                times[name] += mine
                per_round[name].append(statistics.median(mine))
    fsdp_mem = {"params": _local_bytes(fsdp.parameters()),
                "grads": _local_bytes(p.grad for p in fsdp.parameters()),
                "optimizer": _local_bytes(v for st in fsdp_opt.state.values() for v in st.values())}
    return {"times": times, "losses": losses, "per_round": per_round, "ck_mem": engine.memory(),
            "fsdp_mem": fsdp_mem, "n_params": sum(p.numel() for p in GPT(gcfg).parameters())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    gpt = dict(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    results = ck.launch(_rounds, args.ranks, gpt, args.batch, args.rounds, args.steps)
    res = results[0]
    med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
    paired = statistics.median(a / b for a, b in zip(res["per_round"]["colab_kit"], res["per_round"]["fsdp2"]))
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["colab_kit"], res["losses"]["fsdp2"]))
    print(f"GPT {gpt} ({res['n_params']:,} parameters), global batch {args.batch}, {args.ranks} ranks, "
          f"{args.rounds} rounds x {args.steps} steps a side, AdamW, torch {torch.__version__}")
    print(f"median step time   colab_kit zero=2 {med['colab_kit']:.2f} ms   FSDP2 (reshard_after_forward=False) "
          f"{med['fsdp2']:.2f} ms   ratio {med['colab_kit'] / med['fsdp2']:.3f}")
    print(f"median of adjacent-round ratios colab_kit / FSDP2  {paired:.3f} (target <= 1.00)")
    dense = 2 * 4 * res["n_params"]
    print(f"bytes held per rank after a step (AdamW dense states: {dense:,} B; / {args.ranks} = "
          f"{dense // args.ranks:,} B):")
    for key in ("optimizer", "grads", "params"):
        cells = "   ".join(f"rank {r}: ck {res_r['ck_mem'][key]:,} / fsdp2 {res_r['fsdp_mem'][key]:,}"
                           for r, res_r in enumerate(results))
        print(f"  {key:<9} {cells}")
    print(f"same work: losses differ by at most {worst:.2e} (relative)")


if __name__ == "__main__":
    main()

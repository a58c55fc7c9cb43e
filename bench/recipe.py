"""The full training recipe, colab_kit ZeRO-3 against FSDP2 ``fully_shard``, dp=2, side by side in one run.

Both sides train the same GPT (same seed) on the same rows of the standard library's text (each rank its
own rows of every global batch, ``ck.datasets.ShardedLoader``) with the same recipe, set up as each
side's users would write it:

- colab_kit: ``ck.boost(model, AdamW(decay_groups(model), foreach=True), ParallelConfig(dp=2, zero=3),
  lr_scheduler=LambdaLR(WarmupCosine), max_grad_norm=1.0)``, ``engine.train_step(local rows)``;
- FSDP2: ``fully_shard`` on every block then on the root, the same AdamW (``foreach=True``) over the two
  groups of its DTensor parameters, the same ``LambdaLR``; per step forward, backward,
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` (over DTensors: the global norm),
  ``opt.step()``, ``opt.zero_grad(set_to_none=False)``, ``sched.step()``, the loss averaged over ranks.

Rounds alternate between the sides (``--rounds`` x ``--steps`` a side, after a warm-up round); the
figure is the median over rounds of each side's median step, and the ratio colab_kit / FSDP2 (below 1:
colab_kit faster). The losses of the two sides are compared step by step. Then the MFU of the demo's GPT
(``colab_kit.cli.MODEL``) under the demo's dp=4, from ``ck.throughput(engine)`` against the matmul peak
measured on this machine. Writes ``bench/results/recipe.json``.

    python bench/recipe.py
    python bench/recipe.py --rounds 8 --steps 4 --d-model 128 --layers 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import colab_kit as ck
from colab_kit.models import GPT, GPTConfig

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.recipe)
    from bench._results import row, write


def _recipe(model, lr, total):
    opt = torch.optim.AdamW(ck.recipe.decay_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), foreach=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, ck.recipe.WarmupCosine(max(1, total // 10), total))


class FSDP2Side:
    """The recipe as an FSDP2 user writes it (see the module docstring)."""

    def __init__(self, gcfg, lr, total, max_norm):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        self.model = GPT(gcfg)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt, self.sched = _recipe(self.model, lr, total)
        self.max_norm, self.world = max_norm, dist.get_world_size()

    def step(self, batch) -> float:
        x, y = batch
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.sched.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        return loss.item() / self.world


def _race(args):
    gcfg = GPTConfig(vocab_size=256, seq_len=args["seq"], d_model=args["d_model"], n_heads=4, n_layers=args["layers"])
    total = (args["rounds"] + 1) * args["steps"]
    text = ck.datasets.TextCorpus.stdlib(args["seq"])
    rank = dist.get_rank()
    model = GPT(gcfg)
    opt, sched = _recipe(model, args["lr"], total)
    engine = ck.boost(model, opt, ck.ParallelConfig(dp=dist.get_world_size(), zero=3), lr_scheduler=sched,
                      max_grad_norm=args["max_norm"])
    ours_data = engine.loader(text, args["batch"], seed=0)
    peer = FSDP2Side(gcfg, args["lr"], total, args["max_norm"])
    peer_data = ck.datasets.ShardedLoader(text, args["batch"], dp_size=dist.get_world_size(), dp_rank=rank, seed=0)
    times = {"colab_kit": [], "fsdp2": []}
    losses = {"colab_kit": [], "fsdp2": []}
    sides = {"colab_kit": (lambda b: engine.train_step(b), ours_data), "fsdp2": (peer.step, peer_data)}
    for r in range(args["rounds"] + 1):
        order = ("colab_kit", "fsdp2") if r % 2 == 0 else ("fsdp2", "colab_kit")
        for name in order:
            step, data = sides[name]
            per = []
            for _ in range(args["steps"]):
                batch = next(data)
                dist.barrier()
                t0 = time.perf_counter()
                losses[name].append(step(batch))
                per.append(time.perf_counter() - t0)
            if r > 0:  # round 0 warms both up
                times[name].append(statistics.median(per))
    engine.close()
    return {"times": times, "losses": losses}


def _demo_mfu(steps):
    from colab_kit import cli
    model = GPT(GPTConfig(**cli.MODEL))
    opt, sched = cli._recipe(model, 3e-3, steps)
    engine = ck.boost(model, opt, ck.ParallelConfig(dp=dist.get_world_size()), lr_scheduler=sched,
                      max_grad_norm=cli.MAX_GRAD_NORM)
    loader = engine.loader(ck.datasets.TextCorpus.stdlib(cli.MODEL["seq_len"]), 32, seed=0)
    for _ in range(steps):
        engine.train_step(next(loader))
    dist.barrier()
    out = ck.throughput(engine) if dist.get_rank() == 0 else None  # rank 0 measures the peak while the others wait
    dist.barrier()
    engine.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", dest="d_model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-norm", dest="max_norm", type=float, default=1.0)
    ap.add_argument("--demo-steps", dest="demo_steps", type=int, default=30)
    args = vars(ap.parse_args(argv))
    got = ck.launch(_race, args["ranks"], args)[0]
    med = {k: statistics.median(v) for k, v in got["times"].items()}
    ratio = med["colab_kit"] / med["fsdp2"]
    diffs = [abs(a - b) / abs(b) for a, b in zip(got["losses"]["colab_kit"], got["losses"]["fsdp2"])]
    worst, early = max(diffs), max(diffs[:8])  # later steps drift apart as rounding differences grow with training
    print(f"recipe (AdamW foreach, 2 param groups, warmup + cosine, clip {args['max_norm']}), GPT d={args['d_model']} "
          f"x {args['layers']}, batch {args['batch']} x seq {args['seq']}, dp={args['ranks']}:")
    print(f"  colab_kit zero=3   {1e3 * med['colab_kit']:8.2f} ms/step")
    print(f"  FSDP2 fully_shard  {1e3 * med['fsdp2']:8.2f} ms/step")
    print(f"  ratio colab_kit / FSDP2 = {ratio:.3f}; relative loss difference over the first 8 steps {early:.2e}, "
          f"over all {len(diffs)} {worst:.2e} (float rounding differences grow as training goes on)")
    demo = ck.launch(_demo_mfu, 4, args["demo_steps"])[0]
    from colab_kit.observe.throughput import format_throughput
    from colab_kit.cli import MODEL
    print(f"the demo's GPT {MODEL} under dp=4: {format_throughput(demo)}")
    write("recipe", [
        row(f"the full recipe (AdamW foreach, 2 param groups, warmup + cosine, clipping), ZeRO-3, dp={args['ranks']}, "
            f"GPT d={args['d_model']} x {args['layers']}, batch {args['batch']}", f"{1e3 * med['colab_kit']:.2f} ms/step",
            f"FSDP2 fully_shard + clip_grad_norm_ {1e3 * med['fsdp2']:.2f} ms/step", ratio,
            f"ratio of medians, the same AdamW (foreach) and schedule; losses within {early:.1e} over the first 8 steps"),
        row(f"the demo's GPT under dp=4 ({args['demo_steps']} steps)", format_throughput(demo), None, None,
            "MFU against the matmul peak measured on this machine")],
        {"median_s": med, "ratio": ratio, "max_loss_difference_first_8": early, "max_loss_difference": worst,
         "rounds_s": got["times"], "demo_throughput": demo}, args, argv)


if __name__ == "__main__":
    main()

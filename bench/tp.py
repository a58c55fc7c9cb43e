"""Tensor parallelism: colab_kit 1D against PyTorch DTensor ``parallelize_module``.

Part 1, side by side in one run on 2 ranks: the same GPT blocks (attention q/k/v
column-wise, proj row-wise, MLP fc1 column-wise, fc2 row-wise) trained with SGD,
once sharded by colab_kit's 1D layers, once by DTensor's ColwiseParallel /
RowwiseParallel, alternating in rounds. Prints median step times, their ratio
(target <= 1.10) and the bytes each hands to collectives per step (target: not more).

Part 2: parameter bytes per rank of each mode against the theory (1/P for 1D,
1/q^2 for 2D and 2.5D, 1/q^3 for 3D), measured on tp=4 and tp=8.

    python bench/tp.py
    python bench/tp.py --rounds 4 --skip-modes
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import colab_kit as ck
from colab_kit.models import GPT, GPTConfig


class _CountCollectiveBytes(TorchDispatchMode):
    """Counts the input bytes of every functional collective DTensor issues (not the
    ``wait_tensor`` / ``_wrap_tensor_autograd`` bookkeeping ops around them)."""

    COLLECTIVES = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "all_to_all_single", "broadcast", "broadcast_"}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in self.COLLECTIVES:
            t = args[0]
            tensors = t if isinstance(t, (list, tuple)) else [t]
            self.bytes += sum(x.numel() * x.element_size() for x in tensors if isinstance(x, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _blocks(gcfg):
    return nn.Sequential(*GPT(gcfg).blocks)


def _compare(gpt_kwargs, batch, rounds, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from colab_kit.tensor.tp1d import ColumnLinear, RowLinear

    gcfg = GPTConfig(**gpt_kwargs)
    mesh = ck.ProcessMesh(ck.ParallelConfig(tp=torch.distributed.get_world_size()))
    ours = _blocks(gcfg)
    for b in ours:
        b.attn.qkv = ColumnLinear.from_dense(b.attn.qkv, mesh)
        b.attn.proj = RowLinear.from_dense(b.attn.proj, mesh)
        b.mlp.fc1, b.mlp.fc2 = ColumnLinear.from_dense(b.mlp.fc1, mesh), RowLinear.from_dense(b.mlp.fc2, mesh)
    dmesh = init_device_mesh("cpu", (mesh.size("tp"),), mesh_dim_names=("tp",))
    theirs = _blocks(gcfg)
    plan = {}
    for i in range(len(theirs)):
        plan.update({f"{i}.attn.qkv": ColwiseParallel(), f"{i}.attn.proj": RowwiseParallel(),
                     f"{i}.mlp.fc1": ColwiseParallel(), f"{i}.mlp.fc2": RowwiseParallel()})
    theirs = parallelize_module(theirs, dmesh, plan)
    models = {"colab_kit": ours, "dtensor": theirs}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-2) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, gcfg.seq_len, gcfg.d_model, generator=g) for _ in range(steps)]
    times, nbytes, losses = {k: [] for k in models}, {}, {k: [] for k in models}

    def step(name, x):
        opts[name].zero_grad()
        loss = models[name](x).pow(2).mean()
        loss.backward()
        opts[name].step()
        return loss.item()

    for r in range(rounds + 1):
        for name in (("colab_kit", "dtensor") if r % 2 == 0 else ("dtensor", "colab_kit")):
            torch.distributed.barrier()
            for x in xs:
                t0 = time.perf_counter()
                losses[name].append(step(name, x))
                if r:
                    times[name].append(time.perf_counter() - t0)
    mark = len(mesh.log.records)
    step("colab_kit", xs[0])
    nbytes["colab_kit"] = sum(rec.bytes for rec in mesh.log.records[mark:])
    nbytes["colab_kit_wire"] = sum(rec.wire for rec in mesh.log.records[mark:])
    with _CountCollectiveBytes() as counter:
        step("dtensor", xs[0])
    nbytes["dtensor"] = counter.bytes
    return {"times": times, "bytes": nbytes, "losses": losses}


def _param_bytes(cases, gpt_kwargs):
    out = {}
    for kw in cases:
        cfg = ck.ParallelConfig(**kw)
        engine = ck.boost(GPT(GPTConfig(**gpt_kwargs)), lambda ps: torch.optim.SGD(ps, lr=0.1), cfg)
        linear = sum(p.numel() * 4 for n, p in engine.module.named_parameters()
                     if n.startswith("blocks") and p.dim() == 2)
        out[cfg.describe()] = {"params": engine.memory()["params"], "block_matrices": linear, "tp_mode": cfg.tp_mode,
                               "tp": cfg.tp, "q": cfg.tp_q, "depth": cfg.tp_depth}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--skip-modes", action="store_true", help="skip part 2 (needs 8 ranks)")
    args = ap.parse_args(argv)
    gpt = dict(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=8, n_layers=args.layers)
    res = ck.launch(_compare, 2, gpt, args.batch, args.rounds, args.steps)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["colab_kit"], res["losses"]["dtensor"]))
    print(f"GPT blocks {gpt}, batch {args.batch}, tp=2, {args.rounds} rounds x {args.steps} steps")
    print(f"median step time   colab_kit 1D {med['colab_kit']:.2f} ms   DTensor {med['dtensor']:.2f} ms   "
          f"ratio {med['colab_kit'] / med['dtensor']:.3f} (target <= 1.10)")
    print(f"payload bytes to collectives per step   colab_kit {res['bytes']['colab_kit']:,}   DTensor "
          f"{res['bytes']['dtensor']:,}   ratio {res['bytes']['colab_kit'] / max(1, res['bytes']['dtensor']):.3f}"
          f"   (colab_kit sends {res['bytes']['colab_kit_wire']:,} B on the wire, ring model)")
    print(f"max relative loss difference between the two: {worst:.2e}")
    if args.skip_modes:
        return
    small = dict(vocab_size=64, seq_len=16, d_model=64, n_heads=4, n_layers=2)
    dense = GPT(GPTConfig(**small))
    dense_matrices = sum(p.numel() * 4 for n, p in dense.named_parameters() if n.startswith("blocks") and p.dim() == 2)
    dense_all = dense.num_parameters() * 4
    rows = {}
    rows.update(ck.launch(_param_bytes, 4, [dict(tp=4), dict(tp=4, tp_mode="2d")], small)[0])
    rows.update(ck.launch(_param_bytes, 8, [dict(tp=8, tp_mode="2.5d", tp_depth=2), dict(tp=8, tp_mode="3d")],
                          small)[0])
    print(f"\nparameter bytes per rank (rank 0), GPT {small}: dense model {dense_all:,} B, "
          f"of which block matrices {dense_matrices:,} B")
    print(f"{'config':34} {'params':>9} {'whole share':>12} {'block matrices':>15} {'block share':>12} {'theory':>8}")
    for name, r in rows.items():
        theory = {"1d": r["tp"], "2d": r["q"] ** 2, "2.5d": r["q"] ** 2, "3d": r["q"] ** 3}[r["tp_mode"]]
        print(f"{name:34} {r['params']:>9,} {'1/' + format(dense_all / r['params'], '.2f'):>12} "
              f"{r['block_matrices']:>15,} {'1/' + format(dense_matrices / r['block_matrices'], '.2f'):>12} "
              f"{'1/' + str(theory):>8}")
    print("whole share: every parameter on the rank (embeddings, LayerNorms and biases too) against the dense "
          "model; 2.5D's theory is per depth layer (1/q^2); small models keep LayerNorms and position tables "
          "above the share")


if __name__ == "__main__":
    main()

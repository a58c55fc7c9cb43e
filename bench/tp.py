"""Tensor parallelism: colab_kit 1D against PyTorch DTensor ``parallelize_module``, on the whole GPT.

Part 1, side by side in one run on 2 ranks: the same GPT (same seed), the same batches and SGD, trained
once through ``ck.boost(model, opt, ParallelConfig(tp=2))`` and ``engine.train_step`` (what a colab_kit user
writes), once sharded by DTensor the way torchtitan's users do it (``_dtensor_gpt``: a vocab-parallel token
table, column- and row-parallel q/k/v, proj, fc1, fc2, a column-parallel head with ``loss_parallel``),
alternating in rounds. Prints median step times and their ratio (target <= 1.10), the bytes each hands to
tp collectives per step (target: not more), and the largest loss difference between them.

Part 2: parameter bytes per rank of each mode against the theory (1/P for 1D,
1/q^2 for 2D and 2.5D, 1/q^3 for 3D), measured on tp=4 and tp=8.

Writes ``bench/results/tp.json``.

    python bench/tp.py
    python bench/tp.py --rounds 4 --skip-modes
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import colab_kit as ck
from colab_kit.models import GPT, GPTConfig

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.tp)
    from bench._results import row, write


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


def _dtensor_gpt(gcfg, tp: int):
    """The GPT as a user of DTensor sets it up (torchtitan's 1D plan): a vocab-parallel token table
    (``RowwiseParallel`` with a replicated input), each block's fused q/k/v and fc1 ``ColwiseParallel``, proj and
    fc2 ``RowwiseParallel``, the head ``ColwiseParallel`` with its logits left sharded over the vocabulary for
    ``loss_parallel``; the attention's head count divided by tp (the q/k/v columns are ordered head by head, so
    a contiguous split is a set of whole heads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = GPT(gcfg)
    plan = {"tok": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        block.attn.n_heads //= tp
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc1": ColwiseParallel(), f"blocks.{i}.mlp.fc2": RowwiseParallel()})
    return parallelize_module(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), plan)


def _compare(gpt_kwargs, batch, rounds, steps):
    """The whole GPT, one training step each side: colab_kit's ``ck.boost(..., ParallelConfig(tp=2))`` and
    ``engine.train_step``, against DTensor's ``parallelize_module`` with ``loss_parallel`` and the same SGD."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from colab_kit.datasets import SyntheticTokens

    torch.set_num_threads(1)
    tp = torch.distributed.get_world_size()
    gcfg = GPTConfig(**gpt_kwargs)
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-2)  # noqa: E731
    engine = ck.boost(GPT(gcfg), sgd, ck.ParallelConfig(tp=tp))
    theirs = _dtensor_gpt(gcfg, tp)
    their_opt = sgd(theirs.parameters())
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0)
    batches = [data.batch(s, batch) for s in range(steps)]

    def dtensor_step(x, y):
        their_opt.zero_grad()
        logits = theirs(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        their_opt.step()
        return loss.full_tensor().item()

    runners = {"colab_kit": lambda x, y: engine.train_step((x, y)), "dtensor": dtensor_step}
    times, nbytes, losses = {k: [] for k in runners}, {}, {k: [] for k in runners}
    for r in range(rounds + 1):  # round 0 warms up both
        for name in (("colab_kit", "dtensor") if r % 2 == 0 else ("dtensor", "colab_kit")):
            torch.distributed.barrier()
            for x, y in batches:
                t0 = time.perf_counter()
                loss = runners[name](x, y)
                if r:
                    times[name].append(time.perf_counter() - t0)
                else:
                    losses[name].append(loss)
    records = engine.comm(last_step=True)
    nbytes["colab_kit"] = sum(rec["bytes"] for rec in records if rec["axis"] == "tp")
    nbytes["colab_kit_wire"] = sum(rec["wire"] for rec in records if rec["axis"] == "tp")
    with _CountCollectiveBytes() as counter:
        dtensor_step(*batches[0])
    nbytes["dtensor"] = counter.bytes
    engine.close()
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
    paired = statistics.median(a / b for a, b in zip(_rounds(res["times"]["colab_kit"], args.steps),
                                                     _rounds(res["times"]["dtensor"], args.steps)))
    print(f"GPT {gpt}, batch {args.batch}, tp=2, {args.rounds} rounds x {args.steps} steps")
    print(f"median step time   colab_kit 1D {med['colab_kit']:.2f} ms   DTensor {med['dtensor']:.2f} ms   "
          f"ratio {med['colab_kit'] / med['dtensor']:.3f}; median of adjacent-round ratios {paired:.3f} "
          f"(target <= 1.10)")
    print(f"payload bytes to collectives per step   colab_kit {res['bytes']['colab_kit']:,}   DTensor "
          f"{res['bytes']['dtensor']:,}   ratio {res['bytes']['colab_kit'] / max(1, res['bytes']['dtensor']):.3f}"
          f"   (colab_kit sends {res['bytes']['colab_kit_wire']:,} B on the wire, ring model)")
    print(f"max relative loss difference between the two: {worst:.2e}")
    b = res["bytes"]
    rows_out = [row(f"tensor parallel 1D, tp=2, whole GPT d={args.d_model} x {args.layers} layers, batch {args.batch}",
                    f"{med['colab_kit']:.2f} ms/step", f"DTensor parallelize_module {med['dtensor']:.2f} ms/step",
                    paired, f"median of adjacent-round ratios (goal <= 1.10); tp payload bytes a step colab_kit "
                            f"{b['colab_kit']:,}, DTensor {b['dtensor']:,}; losses within {worst:.1e}")]
    figures = {"median_ms": med, "paired_ratio": paired, "bytes": b, "max_loss_rel_diff": worst}
    if args.skip_modes:
        write("tp", rows_out, figures, vars(args), argv)
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
    figures["param_bytes"] = {"dense": dense_all, "dense_block_matrices": dense_matrices, "per_config": rows}
    write("tp", rows_out, figures, vars(args), argv)


def _rounds(times: list[float], steps: int) -> list[float]:
    """The median step of each round (``steps`` steps a round)."""
    return [statistics.median(times[i:i + steps]) for i in range(0, len(times), steps)]


if __name__ == "__main__":
    main()

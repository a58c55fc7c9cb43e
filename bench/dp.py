"""Data parallelism: colab_kit dp=2 against torch DDP, side by side in one run.

Both train the same GPT (same seed) from the same batches on the same two local
ranks, with the same optimizer, for the same number of steps, and every step of
each side is timed whole: batch, forward, backward, gradient all-reduce, optimizer
step, zeroing and the global loss (one 4-byte all-reduce on each side).

The runs alternate in short rounds, ABBA (colab_kit, DDP, DDP, colab_kit, ...), so
that machine noise hits both alike; on a shared machine the load drifts within
seconds, so the headline ratio is the median over rounds of (colab_kit / DDP) of
adjacent rounds, printed beside the ratio of the overall medians and the ratio of
main-thread CPU time (``time.thread_time``: the work done, not the waiting, so
the least sensitive to other processes). Target: <= 1.00 (at or below DDP).

It also checks that neither side skipped work: both sides' losses agree step by
step, their final parameters agree, and it prints the gradient bytes each side
all-reduced per step (colab_kit: its comm records; DDP: its reducer's bucket sizes
from ``_get_ddp_logging_data``), which must both equal the parameter bytes.

    python bench/dp.py                  # defaults: 2 ranks, 30 rounds of 3 steps
    python bench/dp.py --rounds 10 --steps 5 --d-model 64
    python bench/dp.py --ddp-bucket-view  # DDP with gradient_as_bucket_view=True (as colab_kit)
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

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.dp)
    from bench._results import row, write


def _ddp_bucket_bytes(ddp) -> tuple[int, int] | None:
    """(bytes, buckets) DDP's reducer all-reduces per step, from its logging data (None if unavailable)."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # a private API: report nothing rather than fail the benchmark
        return None
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    if not sizes:
        return None
    sizes = [int(s) for s in str(sizes).split(",") if s.strip()]
    return sum(sizes), len(sizes)


def _rounds(gpt_kwargs: dict, batch: int, rounds: int, steps: int, bucket_mb: float | None, bucket_view: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = torch.distributed
    cfg = ck.ParallelConfig(dp=dist.get_world_size())
    gcfg = GPTConfig(**gpt_kwargs)
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0)
    adam = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    engine = ck.boost(GPT(gcfg), adam, cfg)
    ddp_kwargs = {"bucket_cap_mb": bucket_mb} if bucket_mb else {}
    ddp = DDP(GPT(gcfg), gradient_as_bucket_view=bucket_view, **ddp_kwargs)
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

    names = ("colab_kit", "ddp")
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    losses = {n: [] for n in names}
    per_round = {n: [] for n in names}
    runners = {"colab_kit": lambda s: engine.train_step(data.batch(s, batch)), "ddp": ddp_step}
    grad_bytes = []
    for r in range(rounds + 1):  # round 0 warms up both
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            mine = []
            for s in range(steps):
                c0, t0 = time.thread_time(), time.perf_counter()
                loss = runners[name](r * steps + s)
                t, c = time.perf_counter() - t0, time.thread_time() - c0
                if r:
                    mine.append(t)
                    times[name].append(t)
                    cpu[name].append(c)
                    losses[name].append(loss)
                if name == "colab_kit":  # every step, so that a step that skipped its all-reduce shows
                    grad_bytes.append(sum(rec.bytes for rec in engine.mesh.log.last_step()
                                          if rec.tag.startswith("grad")))
            if r:
                per_round[name].append(statistics.median(mine))
    ddp_params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    return {"times": times, "cpu": cpu, "losses": losses, "per_round": per_round,
            "comm": engine.comm(last_step=True), "grad_bytes": grad_bytes,
            "ddp_bytes": _ddp_bucket_bytes(ddp),
            "param_diff": (ck.state_vector(engine) - ddp_params).abs().max().item(),
            "param_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
            "buckets": len(engine.data_parallel.buckets)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's own)")
    ap.add_argument("--ddp-bucket-view", action="store_true",
                    help="DDP with gradient_as_bucket_view=True (default: DDP's default, False)")
    args = ap.parse_args(argv)
    gpt = dict(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    res = ck.launch(_rounds, args.ranks, gpt, args.batch, args.rounds, args.steps, args.bucket_mb,
                    args.ddp_bucket_view)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
    cpu = {k: statistics.median(v) * 1e3 for k, v in res["cpu"].items()}
    rounds = res["per_round"]
    paired = statistics.median(a / b for a, b in zip(rounds["colab_kit"], rounds["ddp"]))
    assert len(res["times"]["colab_kit"]) == len(res["times"]["ddp"]), "both sides must run the same steps"
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["colab_kit"], res["losses"]["ddp"]))
    print(f"GPT {gpt}, global batch {args.batch}, {args.ranks} ranks, {args.rounds} rounds x {args.steps} steps "
          f"a side, torch {torch.__version__}, {torch.get_num_threads()} threads in the parent"
          + (", DDP gradient_as_bucket_view=True" if args.ddp_bucket_view else ""))
    print(f"median step time   colab_kit {med['colab_kit']:.2f} ms   torch DDP {med['ddp']:.2f} ms   "
          f"ratio {med['colab_kit'] / med['ddp']:.3f}")
    print(f"median of adjacent-round ratios colab_kit / DDP  {paired:.3f} (target <= 1.00)")
    print(f"main-thread CPU per step   colab_kit {cpu['colab_kit']:.2f} ms   torch DDP {cpu['ddp']:.2f} ms   "
          f"ratio {cpu['colab_kit'] / cpu['ddp']:.3f}")
    gb = res["grad_bytes"]
    loss_bytes = sum(r["bytes"] for r in res["comm"] if not r["tag"].startswith("grad"))
    print(f"gradient bytes all-reduced per step: colab_kit {min(gb):,}..{max(gb):,} in {res['buckets']} buckets "
          f"(+{loss_bytes} B loss)", end="")
    if res["ddp_bytes"] is not None:
        print(f"; DDP {res['ddp_bytes'][0]:,} in {res['ddp_bytes'][1]} buckets (+4 B loss)", end="")
    print(f"; parameter bytes {res['param_bytes']:,}")
    print(f"same work: losses differ by at most {worst:.2e} (relative), final parameters by {res['param_diff']:.2e}")
    same_work = min(gb) == res["param_bytes"] and not (res["ddp_bytes"] and res["ddp_bytes"][0] != res["param_bytes"])
    if not same_work:
        print("WARNING: a side did not all-reduce every gradient byte on every step: the ratio is not comparable")
    what = (f"data parallel, dp={args.ranks}, GPT d={args.d_model} x {args.layers} layers, batch {args.batch}"
            + (", DDP gradient_as_bucket_view" if args.ddp_bucket_view else ""))
    write("dp", [row(what, f"{med['colab_kit']:.2f} ms/step", f"DDP {med['ddp']:.2f} ms/step", paired,
                     f"median of adjacent-round ratios (goal <= 1.00); both all-reduce {min(gb):,} gradient bytes a "
                     f"step; losses within {worst:.1e}")],
          {"median_ms": med, "thread_cpu_ms": cpu, "paired_ratio": paired, "grad_bytes": [min(gb), max(gb)],
           "ddp_bytes": res["ddp_bytes"], "param_bytes": res["param_bytes"], "max_loss_rel_diff": worst,
           "param_diff": res["param_diff"], "same_work": same_work}, vars(args), argv)


if __name__ == "__main__":
    main()

"""Mixture of experts: colab_kit's expert parallelism against transformers' own, side by side in one run.

Four comparisons, each a row (the fourth: four rows) of ``bench/results/moe.json``:

1. **The ep step.** The same Hugging Face Mixtral in miniature (random weights from a config, saved once to a
   temporary directory so both sides load the same bytes), two CPU ranks on gloo, one thread each, the same
   rows per rank, AdamW. colab_kit: ``ck.boost(model, AdamW, ParallelConfig(dp=2, ep=2, zero=Z))``.
   transformers (5.x, the expert parallelism a user of that model would reach for, set up as its docs say):
   ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=2, ep_size=2,
   ep_implementation="all_to_all"))``, which shards the dense weights with FSDP2 and the experts over ep with
   an all-to-all token dispatch (it needs ``accelerate``); each step ``model(x, labels=x,
   output_router_logits=True).loss.backward()``, the optimizer step, zero_grad. Both sides train the model's own
   loss (cross-entropy + ``router_aux_loss_coef`` x the balancing loss). The runs alternate in rounds (ABBA);
   the ratio is the median over rounds of colab_kit / transformers of adjacent rounds (goal <= 1.00). ``Z``
   is 3 (FSDP's counterpart) where the engine runs ZeRO-3 with ep, else 2, named in the row.
2. **Grouped GEMM against the loop** (``colab_kit.models.experts.bench_expert_compute``) at the Mixtral's
   expert sizes and the rows one rank's experts receive, then over ``SWEEP`` (the sizes docs/moe.md tables).
3. **Dispatch bytes against the formula**: the engine's comm records of one step (tags ``expert dispatch``,
   ``expert combine`` and their backward) against ``4 N k d x 4`` bytes per MoE layer summed over the ep group
   (``docs/moe.md``).
4. **Expert tensor parallelism** (``bench/_moe_etp.py``): one expert layer forward + backward at two CPU ranks,
   each expert split over its width with an all-reduce (ETP) against the experts replicated under tp (the
   engine today) and against the pair folded into ep, per token, at a Mixtral-like and a DeepSeek-like width
   (``--etp-rounds`` rounds, ``--steps`` layers per form in each).

    python bench/moe.py                      # defaults: 12 rounds of 3 steps, ETP 30 rounds
    python bench/moe.py --rounds 4 --steps 2 --etp-rounds 8
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import colab_kit as ck
from colab_kit.models.experts import bench_expert_compute

try:
    from _moe_etp import etp_rank, etp_rows
    from _results import row, write
except ImportError:  # python -m bench.moe
    from bench._moe_etp import etp_rank, etp_rows
    from bench._results import row, write

MIXTRAL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
               router_aux_loss_coef=0.02, output_router_logits=True)
SEQ, BATCH = 128, 8
SWEEP = [(4, 32, 128, 128), (8, 32, 128, 256), (8, 64, 256, 1024), (16, 64, 256, 2048)]
"""(experts, d, f, rows) of the expert-compute sweep: the test GPT's sizes up to twice the experts and rows."""


def _batches(step: int) -> torch.Tensor:
    """The global batch of ``step`` (every rank makes the same; each side takes its rank's rows)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, MIXTRAL["vocab_size"], (BATCH, SEQ), generator=g)


def _hf_side(path: str):
    """transformers' own expert parallelism over this world (FSDP2 + EP with an all-to-all dispatch)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig
    world = torch.distributed.get_world_size()
    dc = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=dc, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = torch.distributed.get_rank()

    def step(s: int) -> float:
        x = _batches(s).chunk(world)[rank]
        out = model(x, labels=x, output_router_logits=True)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return float(out.loss.detach())
    return step


def _ck_side(path: str, zero: int):
    from transformers import AutoModelForCausalLM
    world = torch.distributed.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(dp=world, ep=world, zero=zero))

    def step(s: int) -> float:  # HF's labels=x: the targets are x shifted, the last position unscored
        x = _batches(s)
        y = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        return engine.train_step((x, y))
    return step, engine


def _rank(path: str, rounds: int, steps: int, zero: int) -> dict:
    torch.manual_seed(0)
    ours, engine = _ck_side(path, zero)
    theirs = _hf_side(path)
    times: dict[str, list[float]] = {"colab_kit": [], "transformers": []}
    order = ["colab_kit", "transformers", "transformers", "colab_kit"]
    fns = {"colab_kit": ours, "transformers": theirs}
    s = 0
    for r in range(rounds):
        for side in order[(r % 2) * 2:(r % 2) * 2 + 2]:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[side](s)
                s += 1
            torch.distributed.barrier()
            times[side].append((time.perf_counter() - t0) / steps)
    records = [r for r in ck.engine.reports.comm(engine, True) if r["tag"].startswith("expert")]
    engine.close()
    return {"times": times, "records": records}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--etp-rounds", type=int, default=30, help="rounds of the expert tensor parallelism comparison")
    ap.add_argument("--zero", type=int, default=None, help="colab_kit's ZeRO stage (default: 3 if ep runs it, else 2)")
    args = ap.parse_args(argv)
    from transformers import MixtralConfig, MixtralForCausalLM
    from colab_kit.engine.core import unsupported
    zero = args.zero
    if zero is None:
        zero = 2 if unsupported(ck.ParallelConfig(dp=2, ep=2, zero=3), None) else 3
    rows, figures = [], {"model": MIXTRAL, "seq": SEQ, "batch": BATCH}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        MixtralForCausalLM(MixtralConfig(**MIXTRAL)).save_pretrained(tmp)
        res = ck.launch(_rank, 2, tmp, args.rounds, args.steps, zero, threads=1, timeout=1800)
    t = res[0]["times"]
    pairs = [a / b for a, b in zip(t["colab_kit"], t["transformers"])]
    ratio = statistics.median(pairs)
    ck_ms, hf_ms = 1e3 * statistics.median(t["colab_kit"]), 1e3 * statistics.median(t["transformers"])
    rows.append(row(f"MoE ep step, Mixtral mini (8 experts top-2, d 128), dp=2 ep=2 zero={zero}, 2 CPU ranks",
                    f"{ck_ms:.1f} ms/step", f"transformers FSDP2+EP all_to_all {hf_ms:.1f} ms/step", ratio,
                    "median of adjacent-round ratios; goal <= 1.00"))
    figures["times"] = t
    # 2. grouped GEMM against the loop, at the Mixtral's expert sizes and one rank's rows, then over the sizes
    # docs/moe.md tables (EXPERT_COMPUTE's choice rests on all of them)
    torch.set_num_threads(1)
    mixtral = (MIXTRAL["num_local_experts"], MIXTRAL["hidden_size"], MIXTRAL["intermediate_size"],
               BATCH // 2 * SEQ * MIXTRAL["num_experts_per_tok"])
    figures["expert_compute_sweep"] = []
    for n, dm, f, r in [mixtral, *SWEEP]:
        ms = bench_expert_compute(n, dm, f, r)
        if (n, dm, f, r) == mixtral:
            figures["expert_compute_ms"] = ms
        else:
            figures["expert_compute_sweep"].append({"experts": n, "d": dm, "f": f, "rows": r, "ms": ms})
        rows.append(row(f"expert compute, {n} x {dm} x {f}, {r} rows, fwd+bwd, 1 thread",
                        f"grouped_mm {ms['grouped_mm']:.2f} ms", f"loop {ms['loop']:.2f} ms",
                        ms["grouped_mm"] / ms["loop"], f"padded bmm {ms['padded']:.2f} ms"))
    # 3. dispatch bytes of one step against the formula
    d, k, layers = MIXTRAL["hidden_size"], MIXTRAL["num_experts_per_tok"], MIXTRAL["num_hidden_layers"]
    tokens = BATCH // 2 * SEQ
    want = 2 * tokens * k * d * 4 * layers  # dispatch + combine's transpose, this rank's N k d x 4 each
    got = sum(r["bytes"] for r in res[0]["records"] if r["tag"] in ("expert dispatch", "expert combine backward"))
    figures["dispatch_records"] = res[0]["records"]
    rows.append(row("dispatch bytes of one step, rank 0 (dispatch + the combine's backward)", f"{got:,} B",
                    f"formula 2 N k d x 4 x layers = {want:,} B", got / want, "must be 1.00"))
    # 4. expert tensor parallelism against the experts replicated under tp and against folding the pair into ep
    etp = ck.launch(etp_rank, 2, args.etp_rounds, args.steps, threads=1, timeout=1800)
    etp_table, figures["etp"] = etp_rows(etp[0], row)
    rows.extend(etp_table)
    path = write("moe", rows, figures, vars(args), argv)
    for r in rows:
        print(f"{r['what']}: {r['colab_kit']} vs {r['peer']} -> ratio {r['ratio']}  ({r['note']})")
    print(f"figures in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``ck.plan`` at scale against the published layouts: Megatron-LM Table 1, and how fast the plan is.

    python bench/plan_scale.py          # writes bench/results/plan_scale.json

For each Table 1 row (A100 80GB, fp16, seq 2048): the plan within what the published run could choose
(``PUBLISHED_SPACE``: full recomputation, no ZeRO, 1D tensor parallelism, 1F1B or interleaved) and the
published layout's rank in it; the plan with everything the engine runs, its first choice and how much
faster it is estimated than the published layout; and the seconds each plan took here. The peer of each row
is the published layout as ``ck.estimate`` prices it (what Megatron-LM chose), so a ratio below 1 is a layout
the plan estimates faster. Then one published run the model was not fitted on, with layout choices Table 1
has not: Korthikanti et al. 2022 (530B on 2,240 A100s, MFU 54.2% with selective recomputation and sequence
parallelism, 42.1% with full recomputation; the global batch and interleaving are our assumptions, as
Table 1's 530B row).

Where the planning time goes (``speed``: 175B on 1,536 GPUs, then 1T on 3,072 in a fresh process; py-spy
samples of ``ck.plan``, by hand, once, on this 2-core machine, before and after issue 50's changes, which give
the same candidates to the last bit)::

                                                     before         after
                                                   175B    1T    175B    1T
    plan, seconds                                   5.6    2.9     1.6   1.35
    ModelShape.params, every block summed per call  22%    25%    0.5%   0.4%
    configs built and bounded (price)               47%    14%     35%     9%
    memory estimates (config_estimate, memory_of)   14%    28%     31%    26%
    pipeline plans built and walked, once each       7%    29%     20%    59%
    variants priced, the search's own loop           9%     3%     11%     4%

Before: ``ModelShape.params`` summed its 96 or 128 blocks on each of 17,764 calls (two per memory estimate);
all 49,111 configs of 175B were built and bounded by a full ``price``, and a block's compute and collectives
were priced again for each of them; the candidates were sorted again after each config (3 million keys). After:
``params`` once per shape (``shape._formula_params``); a block's compute and collectives once per microbatch
shape (``planner.cluster.terms.per_block``); a layout's configs built only once the search reaches its floor
(``planner.cluster.price.compute_floor``: 17,285 of the 49,111 bounded); a config that comes twice priced once; the best
``limit`` kept in order by insertion; a plan's ranks' stages and a stage's bytes once
(``memory.estimator``). What is left is mostly building the pipeline plans (``pipeline.schedules``, once per
schedule, depth, microbatch count and chunks) and ``memory_of``'s per-call copy of the GPT config.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import row, write  # noqa: E402

import colab_kit as ck  # noqa: E402
from colab_kit.models import GPTConfig  # noqa: E402
from colab_kit.planner.published import MEGATRON_2021, PUBLISHED_SPACE, as_run, table1  # noqa: E402
from colab_kit.planner.shape import ModelShape  # noqa: E402

HW = MEGATRON_2021  # the DGX A100 preset with attention unfused, as the 2021 runs ran it (planner.published)


def _layout(c) -> tuple:
    return (c.dp, c.tp, c.pp, c.sp, c.tp_mode, c.sp_mode, c.microbatches, c.schedule, c.chunks, c.zero, c.recompute)


def table1_rows() -> tuple[list[dict], dict]:
    rows, figures = [], {}
    for r in table1():
        shape, published, batch = as_run(r)
        mine = ck.estimate(shape, published, batch, hardware=HW)
        t0 = time.perf_counter()
        within = ck.plan(shape, published.world_size, batch, precision="fp16", hardware=HW, restrict=PUBLISHED_SPACE,
                         limit=3)
        t1 = time.perf_counter()
        free = ck.plan(shape, published.world_size, batch, precision="fp16", hardware=HW, limit=3)
        t2 = time.perf_counter()
        rank = next((i for i, c in enumerate(within) if _layout(c.config) == _layout(published)), None)
        best, top = within[0], free[0]
        figures[r["model"]] = {
            "published": published.describe(), "published_estimate_s": mine.step_seconds,
            "published_measured_s": r["iteration_seconds"], "published_rank_in_space": rank,
            "space_top3": [(c.config.describe(), c.step_seconds) for c in within],
            "free_top3": [(c.config.describe(), c.step_seconds, c.estimate.mfu) for c in free],
            "plan_seconds_space": t1 - t0, "plan_seconds_free": t2 - t1}
        where = f"#{rank + 1}" if rank is not None else "not in the first 3"
        rows.append(row(f"Table 1 {r['model']} on {published.world_size} A100s: plan within the published space",
                        f"{best.describe()} {best.step_seconds:.2f} s (published layout {where})",
                        f"published layout {mine.step_seconds:.2f} s", best.step_seconds / mine.step_seconds,
                        f"estimates; planned in {t1 - t0:.2f} s"))
        rows.append(row(f"Table 1 {r['model']} on {published.world_size} A100s: plan with every mode",
                        f"{top.describe()} {top.step_seconds:.2f} s, MFU {100 * top.estimate.mfu:.1f}%",
                        f"published layout {mine.step_seconds:.2f} s, MFU {100 * mine.mfu:.1f}%",
                        top.step_seconds / mine.step_seconds, f"estimates; planned in {t2 - t1:.2f} s"))
    return rows, figures


def korthikanti_530b() -> tuple[list[dict], dict]:
    """530B (105 layers, hidden 20480, 128 heads) on 2,240 A100s: tp 8, pp 35, dp 8."""
    shape = ModelShape(layers=105, hidden=20480, heads=128, vocab=51200, seq=2048, name="GPT 530B")
    base = ck.ParallelConfig(dp=8, tp=8, pp=35, microbatches=280, schedule="interleaved", chunks=3, precision="fp16")
    sel = ck.estimate(shape, base.replace(sp_mode="split_gather", recompute="selective"), 2240, hardware=HW)
    full = ck.estimate(shape, base.replace(recompute="full"), 2240, hardware=HW)
    rows = [row("Korthikanti et al. 2022, 530B on 2,240 A100s, selective + sequence parallelism (not fitted)",
                f"MFU {100 * sel.mfu:.1f}%", "MFU 54.2% (published)", sel.mfu / 0.542,
                "batch 2240 and interleaving (3 chunks) assumed"),
            row("Korthikanti et al. 2022, 530B on 2,240 A100s, full recomputation (not fitted)",
                f"MFU {100 * full.mfu:.1f}%", "MFU 42.1% (published)", full.mfu / 0.421,
                "batch 2240 and interleaving (3 chunks) assumed")]
    return rows, {"selective_mfu": sel.mfu, "full_mfu": full.mfu, "speedup": full.step_seconds / sel.step_seconds,
                  "published_speedup": 0.542 / 0.421, "selective_fits": sel.fits, "full_fits": full.fits}


def speed() -> tuple[list[dict], dict]:
    """The issue's two plans: 175B on 1,536 GPUs and 1T on 3,072, each in a fresh cache (first call)."""
    out, rows = {}, []
    for name, cfg, gpus in (("175B", GPTConfig(vocab_size=51200, seq_len=2048, d_model=12288, n_heads=96,
                                                n_layers=96), 1536),
                            ("1T", GPTConfig(vocab_size=51200, seq_len=2048, d_model=25600, n_heads=160,
                                             n_layers=128), 3072)):
        t0 = time.perf_counter()
        cands = ck.plan(cfg, gpus, batch=gpus, precision="fp16", hardware=HW)
        took = time.perf_counter() - t0
        out[name] = {"seconds": took, "first": cands[0].config.describe(), "step_s": cands[0].step_seconds}
        rows.append(row(f"ck.plan of GPT {name} on {gpus:,} A100s (every mode), on this machine",
                        f"{took:.1f} s", None, None, "goal < 2 s on 2 cores"))
    return rows, out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help: say so, run nothing
    rows, figures = [], {}
    for part in (speed, table1_rows, korthikanti_530b):
        r, f = part()
        rows += r
        figures[part.__name__] = f
        for x in r:
            print(f"{x['what']}\n    {x['colab_kit']}  |  {x['peer']}  |  ratio {x['ratio']}")
    print("wrote", write("plan_scale", rows, figures))


if __name__ == "__main__":
    main()

"""Mixtures of experts at scale: DeepSeek-V3's published layout priced by ``ck.estimate``, and ``ck.plan`` of two
published MoE models, against what the DeepSeek-V3 report states.

    python bench/moe_plan.py          # writes bench/results/moe_plan.json

DeepSeek-V3 (arXiv 2412.19437): 671B (37B active), PP16 x EP64 x ZeRO-1 DP on 2,048 H800s, sequence 4,096,
batch 15,360, reported 180K H800 GPU hours per trillion tokens (FP8 GEMMs, DualPipe overlapping the
all-to-alls, at most 4 nodes a token, recomputation of RMSNorm and MLA's up-projections). Priced here as the
engine would run it in bf16 (``planner.published.deepseek_v3``): no recomputation (which does not fit),
selective, and full; each row's ratio is the estimated GPU hours per trillion tokens over the reported 180K.
The cost model stays as calibrated on Megatron-LM's Table 1: nothing here is fitted to DeepSeek's figure.
Then the plan (fastest first) for Mixtral 8x7B and Qwen3-30B-A3B on 64 H100s, bf16, and its seconds here.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import row, write  # noqa: E402

import colab_kit as ck  # noqa: E402
from colab_kit.planner.published.deepseek_v3 import REPORTED, layout, model_config  # noqa: E402


def gpu_hours_per_trillion(est) -> float:
    return 1e12 / est.tokens_per_second * est.config.world_size / 3600


def deepseek() -> tuple[list[dict], dict]:
    rows, figures = [], {}
    reported = REPORTED["gpu_hours_per_trillion_tokens"]
    tokens_per_second = 1e12 / (reported * 3600 / REPORTED["gpus"])  # the reported rate
    seconds = REPORTED["batch"] * REPORTED["seq"] / tokens_per_second
    for rc in ("none", "selective", "full"):
        config, batch = layout(recompute=rc)
        est = ck.estimate(model_config(), config, batch, hardware="8xH800-SXM", uneven_stages=True)
        hours = gpu_hours_per_trillion(est)
        implied_mfu = est.model_flops / (seconds * config.world_size * est.peak_flops)
        figures[rc] = {"step_seconds": est.step_seconds, "mfu": est.mfu, "gpu_hours_per_trillion_tokens": hours,
                       "fits": est.fits, "device_gib": est.device_bytes / 2 ** 30,
                       "memory": {k: est.memory[k] for k in ("params", "grads", "optimizer", "activations")},
                       "breakdown": est.breakdown, "reported_step_seconds": seconds,
                       "reported_mfu_by_our_flops": implied_mfu, "assumptions": est.assumptions}
        rows.append(row(f"DeepSeek-V3 671B (37.6B active), PP16 x EP64 x ZeRO-1 DP, 2,048 H800, bf16, "
                        f"recompute={rc}" + ("" if est.fits else " (does not fit 80 GB)"),
                        f"{hours / 1e3:.0f}K GPU h / T tokens ({est.step_seconds:.1f} s/step, MFU {100 * est.mfu:.1f}%)",
                        f"reported {reported / 1e3:.0f}K ({seconds:.1f} s/step, MFU {100 * implied_mfu:.1f}% by "
                        f"our FLOP count)", hours / reported,
                        "estimate / report; the report's FP8 GEMMs, DualPipe overlap and node-limited routing are "
                        "not modelled"))
        print(rows[-1])
    shape = ck.planner.shape.ModelShape.of(model_config())
    figures["params"] = {"total": shape.params, "active": shape.active_params,
                         "active_without_token_table": shape.active_params - shape.vocab * shape.hidden}
    return rows, figures


def dry_run() -> tuple[list[dict], dict]:
    """The published layout's last rank, exactly, as the engine builds it (``ck.dry_run``, fp32: what it runs):
    the built-in MoE GPT of DeepSeek-V3's widths (64 blocks, all MoE, to split evenly over 16 stages; GELU experts
    1.5 times as wide as the SwiGLU ones; multi-head attention in place of MLA: 740B parameters)."""
    from colab_kit.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=129280, seq_len=4096, d_model=7168, n_heads=128, n_layers=64, d_ff=27648,
                    n_experts=256, top_k=8, d_expert=3072, shared_experts=1)
    config = ck.ParallelConfig(dp=128, pp=16, ep=64, zero=1, microbatches=120)
    t0 = time.perf_counter()
    report = ck.dry_run(GPT(cfg, device="meta"), config, rank=2047, batch=15360, hardware=("8xH800-SXM",))
    took = time.perf_counter() - t0
    print(report)
    keys = ("params", "grads", "optimizer", "activations")
    worst = max(abs(report.memory[k] - report.estimate[k]) / max(report.memory[k], 1) for k in keys[:3])
    figures = {"report": str(report), "seconds": took, "exact": {k: report.memory[k] for k in keys},
               "estimate": {k: report.estimate[k] for k in keys}}
    return [row("ck.dry_run rank 2047 of DeepSeek-V3's layout (PP16 x EP64 x ZeRO-1 DP, fp32; a 740B built-in GPT "
                "of its widths)", f"{report.n_params:,} parameters held, model states exact vs estimate within "
                f"{100 * worst:.4f}% (dry run {took:.0f} s)", None, None, "AdamW step counters: the only difference")], figures


def plans() -> tuple[list[dict], dict]:
    from transformers import MixtralConfig, Qwen3MoeConfig
    models = {"Mixtral 8x7B": MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                            num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096),
              "Qwen3-30B-A3B": Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                              moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                              num_key_value_heads=4, head_dim=128, num_experts=128,
                                              num_experts_per_tok=8, max_position_embeddings=4096,
                                              tie_word_embeddings=False)}
    rows, figures = [], {}
    for name, cfg in models.items():
        t0 = time.perf_counter()
        cands = ck.plan(cfg, 64, 512, precision="bf16", hardware="8xH100-SXM", limit=3)
        took = time.perf_counter() - t0
        best = cands[0]
        figures[name] = {"table": cands.table(3), "seconds_to_plan": took,
                         "best": {"config": best.config.describe(), "step_seconds": best.step_seconds,
                                  "mfu": best.estimate.mfu, "breakdown": best.breakdown}}
        rows.append(row(f"ck.plan {name}, 64 H100, bf16, batch 512 x 4096", f"{best.config.describe()}: "
                        f"{best.step_seconds:.2f} s/step, MFU {100 * best.estimate.mfu:.1f}% (planned in {took:.1f} s)",
                        None, None, "first candidate"))
        print(figures[name]["table"])
    return rows, figures


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help: say so, run nothing
    r1, f1 = deepseek()
    r2, f2 = dry_run()
    r3, f3 = plans()
    write("moe_plan", r1 + r2 + r3, {"deepseek_v3": f1, "dry_run": f2, "plans": f3})


if __name__ == "__main__":
    main()

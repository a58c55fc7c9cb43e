"""Operators a training step dispatches, beside the step times the GPU checks measured: is a small model's step
bound by the host's dispatch rather than by the GPU?

    python bench/op_count.py

For each model a GPU check trained on one GPU (``bench/gpu_check.py``'s 125M GPT, ``bench/gpu_moe_check.py``'s
MoE GPT; bf16, AdamW, one rank), one ``ck.boost`` step is run here on one CPU rank with the same layers,
widths, experts and precision, but 64 tokens a row and 2 rows (the number of operators does not depend on
them), under a ``TorchDispatchMode`` that counts every aten operator the step dispatches (forward, backward,
optimizer, the engine's own). Each row puts that count beside the step the GPU check measured (from
``bench/results/gpu_check.json`` / ``gpu_moe_check.json``): measured seconds / operators is the host time per
operator at which dispatch alone would take the whole step. Eager PyTorch spends some microseconds of host
time per operator (``bench/gpu_curves.py``'s ``launch`` sweep measures it on the GPU's machine); where the
implied figure is of that size, the step is bound by the host. Beside it, the count the estimate's host floor
takes (``planner.cluster.host.ops_per_step``) and that floor at the datasheet H200 preset's 5 us an operator,
beside the preset's estimate of the GPU's own work. AdamW runs with ``foreach=True``, as torch picks it for CUDA
tensors. Its host reads are mostly AdamW's reads of its step counts, which live on the CPU even for CUDA
parameters: not device syncs. Last, this CPU's host seconds an operator of the tiny GPT's and MoE GPT's training
steps (``bench/_host_program.py``, the sweep ``bench/gpu_curves.py`` runs on a GPU) beside a tiny ``add_``'s:
the program's operators cost several times the cheapest one. A measurement for the cost model, not a comparison.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

try:
    from _host_program import SIZES, measure_program
    from _results import RESULTS, row, write
except ImportError:  # run as a module (python -m bench.op_count)
    from bench._host_program import SIZES, measure_program
    from bench._results import RESULTS, row, write

PRESET = "8xH200-SXM"  # the datasheet preset: its op_seconds is the 5 us assumption
MODELS = {  # name: (GPTConfig fields, the GPU check's result file, how to read its measured step seconds)
    "125M GPT (gpu_check)": (dict(vocab_size=25600, seq_len=1024, d_model=768, n_heads=12, n_layers=12),
                             "gpu_check.json", "gpt"),
    "MoE GPT (gpu_moe_check)": (dict(vocab_size=256, seq_len=512, d_model=512, n_heads=8, n_layers=12, n_experts=8,
                                     top_k=2, d_expert=1024, aux_loss=0.01), "gpu_moe_check.json", "moe"),
}


def _count(fields: dict) -> dict:
    """On the rank: operators and host reads (``_local_scalar_dense``) of the second of two steps."""
    import torch

    import colab_kit as ck
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.models import GPT, GPTConfig
    from colab_kit.observe.ops import count_ops

    cfg = GPTConfig(**{**fields, "seq_len": 64})
    engine = ck.boost(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=3e-4, foreach=True),  # as on CUDA
                      ck.ParallelConfig(precision="bf16"))
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=2)
    engine.train_step(data.batch(0, 2))
    counted = count_ops(lambda: engine.train_step(data.batch(1, 2)))
    engine.close()
    return {"ops": counted["ops"], "host_reads": counted["host_reads"]}


def _measured(path: str, kind: str) -> tuple[float | None, str]:
    """The step seconds a GPU check measured, and where it ran."""
    try:
        with open(os.path.join(RESULTS, path), encoding="utf-8") as fh:
            d = json.load(fh)
    except OSError:
        return None, "not run"
    device = d.get("device", "?")
    if kind == "gpt":
        return d["checks"]["gpt"]["figures"]["throughput"]["step_seconds"], device
    tokens_per_s = d["checks"]["bf16"]["figures"].get("tokens_per_s")
    fields = MODELS["MoE GPT (gpu_moe_check)"][0]
    return (16 * fields["seq_len"] / tokens_per_s if tokens_per_s else None), device  # its batch: 16 rows


def main(argv=None) -> None:
    import colab_kit as ck

    rows, figures = [], {}
    from colab_kit.models import GPTConfig
    from colab_kit.planner.cluster.host import ops_per_step
    from colab_kit.planner.cluster.hardware import HARDWARE
    from colab_kit.planner.shape import ModelShape

    op_seconds = HARDWARE[PRESET].op_seconds

    for name, (fields, path, kind) in MODELS.items():
        [counted] = ck.launch(_count, 1, fields)
        floor = ops_per_step(ModelShape.of(GPTConfig(**fields)), fields["n_layers"], 1, "bf16", "none")
        est = ck.estimate(GPTConfig(**fields), ck.ParallelConfig(precision="bf16"), 16, hardware=PRESET)  # 16 rows
        priced = {"preset": PRESET, "op_seconds": op_seconds, "floor_seconds": floor * op_seconds,
                  "step_seconds": est.step_seconds, "gpu_seconds": est.step_seconds - est.breakdown["host"], "host_part": est.breakdown["host"]}
        seconds, device = _measured(path, kind)
        per_op = seconds / counted["ops"] if seconds else None
        print(f"{name}: {counted['ops']:,} operators a step ({counted['host_reads']} host reads; the estimate's host "
              f"floor counts {floor:,}: planner.cluster.host); measured step "
              f"{seconds * 1e3 if seconds else float('nan'):.1f} ms on {device}: "
              f"{per_op * 1e6 if per_op else float('nan'):.1f} us of host time per operator would fill it")
        rows.append(row(f"{name}: operators a training step dispatches", f"{counted['ops']:,} operators",
                        f"{floor:,} (the estimate's count)", counted["ops"] / floor,
                        f"step measured on {device}: {seconds * 1e3:.1f} ms = "
                        f"{per_op * 1e6:.1f} us an operator if host-bound" if per_op else "no GPU step measured"))
        print(f"  the estimate on {PRESET}: GPU work {priced['gpu_seconds'] * 1e3:.1f} ms, host floor "
              f"{priced['floor_seconds'] * 1e3:.1f} ms at {op_seconds * 1e6:g} us an operator, step "
              f"{priced['step_seconds'] * 1e3:.1f} ms")
        figures[name] = {**counted, "estimate_ops": floor, "measured_step_seconds": seconds, "device": device,
                         "model": fields, "estimate": priced}
    add = _add_seconds()
    for p in measure_program(False, ("gpt", "gpt-moe"), {**SIZES["cuda"], "timed": 20}):
        what = f"this CPU: host seconds an operator of the tiny {p['family']} family's step ({p['layers']} blocks)"
        if "seconds_per_op" not in p:
            rows.append(row(what, p.get("error") or p.get("skipped"), None, None, "not measured"))
            continue
        print(f"{what}: {p['seconds_per_op'] * 1e6:.2f} us ({p['ops']:,} operators in {p['step_seconds'] * 1e3:.1f} "
              f"ms), a tiny add_ {add * 1e6:.2f} us")
        rows.append(row(what, f"{p['seconds_per_op'] * 1e6:.2f} us", f"a tiny add_: {add * 1e6:.2f} us",
                        p["seconds_per_op"] / add, "the arithmetic at d 64 runs on the same core here: an upper "
                        "bound; bench/gpu_curves.py's program sweep times it with a GPU doing the arithmetic"))
        figures[f"this CPU, {p['family']}"] = {**p, "add_seconds_per_op": add}
    write("op_count", rows, figures, {}, argv)


def _add_seconds(n: int = 2000) -> float:
    """This process's host seconds a tiny ``add_`` (1,024 elements, the CPU): the cheapest operator."""
    import time

    import torch
    x = torch.zeros(1024)
    for _ in range(100):
        x.add_(1.0)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    return (time.perf_counter() - t0) / n


if __name__ == "__main__":
    main()

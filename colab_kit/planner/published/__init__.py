"""Published training runs as data: Megatron-LM's Table 1, the one table the at-scale cost model is fitted on.

``megatron_table1.json`` holds the ten weak-scaling rows of Narayanan et al. 2021 (arXiv 2104.04473, Table 1:
GPT 1.7B to 1T on up to 3,072 A100 80GB) with where each figure was read. ``table1()`` gives the rows with
the iteration time their Eq. 3 implies; ``as_run(row)`` turns one into what ``planner.cluster.price.price`` takes.

Eq. 3 counts the recomputed forward (full recomputation: four forward passes' worth of matmuls)::

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))       iteration time = F / (TFLOP/s per GPU x GPUs)

Worked example, the 1.7B row (B = 512, s = 2048, l = 24, h = 2304, V = 51200, 137 TFLOP/s on 32 GPUs)::

    >>> row = table1()[0]
    >>> row["model"], round(row["iteration_seconds"], 2)
    ('1.7B', 3.53)
    >>> shape, config, batch = as_run(row)
    >>> config.describe()
    'dp=32 = 32 ranks, fp16, recompute'
    >>> batch, shape.hidden, shape.seq
    (512, 2304, 2048)

The 1.7B row's 512 rows are one microbatch of 16 rows per replica: microbatches = GBS / (dp * MBS) = 1.

The runs are priced on ``MEGATRON_2021``, the DGX A100 preset with attention unfused as Megatron-LM ran it
then (its batched products and fused softmax, the scores through HBM): the presets price FlashAttention, what
the engine runs today, which would put the 1.7B row 35% under its published time::

    >>> from colab_kit.planner.cluster.price import price
    >>> round(price(shape, config, batch, MEGATRON_2021).step_seconds / row["iteration_seconds"], 3)
    1.016
    >>> MEGATRON_2021.name, MEGATRON_2021.attention
    ('8xA100-80GB', 'unfused')
"""
from __future__ import annotations

import functools
import json
import os

from ...config import ParallelConfig
from ..cluster.hardware import HARDWARE
from ..shape import ModelShape

__all__ = ["DEEPSPEED_2021", "MEGATRON_2021", "TABLE1", "PUBLISHED_SPACE", "as_run", "eq3_flops", "table1"]

MEGATRON_2021 = HARDWARE["8xA100-80GB"].with_stack("megatron-lm-2021")
"""The hardware the 2021 runs are priced on (Table 1, the calibration; Korthikanti et al. 2022): the DGX A100
preset under Megatron-LM's stack of 2021 (``planner.cluster.stack``): attention unfused, as it ran before
FlashAttention, and its fused LayerNorm, bias-GELU and bias-dropout-add kernels."""

DEEPSPEED_2021 = HARDWARE["8xA100-80GB"].with_stack("deepspeed-2021")
"""DeepSpeed's ZeRO-3 of 2021 on DGX A100 nodes (Megatron-LM's kernels, one all-gather per parameter tensor):
what Megatron-LM's paper compared against (its Fig. 10)."""

TABLE1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_table1.json")
"""Path of Megatron-LM Table 1 as data (rows, sources)."""


PUBLISHED_SPACE = {"recompute": "full", "zero": 0, "sp": 1, "tp_mode": "1d", "sp_mode": "ring",
                   "schedule": ("1f1b", "interleaved"), "precision": "fp16"}
"""What the Table 1 runs could choose among, as ``ck.plan``'s ``restrict``: Megatron-LM in 2021 (fp16, full
recomputation, plain data parallelism, 1D tensor parallelism without sequence splits, 1F1B or interleaved)."""


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    with open(TABLE1) as fh:
        return json.load(fh)


def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron-LM's Eq. 3: FLOPs of one iteration with full recomputation (forward counted twice)."""
    b, s, ll, h, v = batch, seq, layers, hidden, vocab
    return 96.0 * b * s * ll * h * h * (1 + s / (6 * h) + v / (16 * ll * h))


def table1() -> list[dict]:
    """The ten rows, each with ``iteration_seconds`` (Eq. 3's FLOPs over the published TFLOP/s x GPUs) and
    ``seq``, ``vocab`` added; the sources are in ``sources()``."""
    doc = _load()
    out = []
    for row in doc["rows"]:
        flops = eq3_flops(row["global_batch"], doc["seq"], row["layers"], row["hidden"], doc["vocab"])
        out.append({**row, "seq": doc["seq"], "vocab": doc["vocab"], "eq3_flops": flops,
                    "iteration_seconds": flops / (row["tflops_per_gpu"] * 1e12 * row["gpus"])})
    return out


def sources() -> dict:
    """Where each column was read (commit, file), and the paper."""
    doc = _load()
    return {"paper": doc["paper"], **doc["sources"]}


def as_run(row: dict) -> tuple[ModelShape, ParallelConfig, int]:
    """``(ModelShape, ParallelConfig, global batch)`` of a row: fp16, full recomputation, 1F1B, or the
    interleaved schedule with ``chunks = layers / (pp * layers_per_virtual_stage)`` where the row interleaves;
    ``microbatches = global_batch / (dp * microbatch)``."""
    shape = ModelShape(layers=row["layers"], hidden=row["hidden"], heads=row["heads"], vocab=row.get("vocab", 51200),
                       seq=row.get("seq", 2048), name=f"GPT {row['model']}")
    lpv = row.get("layers_per_virtual_stage")
    chunks = row["layers"] // (row["pp"] * lpv) if lpv else 1
    m = row["global_batch"] // (row["dp"] * row["microbatch"])
    config = ParallelConfig(dp=row["dp"], tp=row["tp"], pp=row["pp"], microbatches=m, precision="fp16",
                            recompute="full", schedule="interleaved" if chunks > 1 else "1f1b", chunks=chunks)
    return shape, config, row["global_batch"]

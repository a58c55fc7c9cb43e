"""Published runs of today's stacks (2024-2025, A100 and H100) as data: checked against, never fitted on.

``runs_2024.json`` holds each run as its source printed it (model, layout, throughput, the arithmetic that
turns the throughput into seconds a step, what the source leaves unstated) and, as notes, Megatron-LM's
comparison with DeepSpeed's ZeRO-3 of 2021 (Table 2) with how DeepSpeed issued its collectives then.
``runs()`` turns each run into what ``planner.cluster.price.price`` takes, on the preset and stack it ran:

- torchtitan (FSDP2, SDPA, per-op selective recomputation; its H100s are the 96 GB / 500 W part:
  the ``8xH100-96GB-500W`` preset), eager or under ``torch.compile`` (elementwise fused);
- Megatron-Core r0.8 on H100 (distributed optimizer, sequence parallelism, overlapped gradient reduce,
  parameter gather and tp communication: the ``megatron-core`` stack); its README leaves the microbatch,
  the schedule and the recomputation unstated: taken as one sequence a microbatch, 1F1B, none;
- llm-foundry's MPT (FSDP full shard, FlashAttention, eager PyTorch elsewhere).

Worked example, the first run::

    >>> r = runs()[0]
    >>> r["name"], r["config"].describe(), r["hardware"], r["stack"].name, r["published"]
    ('torchtitan Llama 3.1 8B FSDP2 (eager), 8 H100', 'dp=8 = 8 ranks, zero=3, bf16, op recompute', \
'8xH100-96GB-500W', 'torchtitan', 2.843)
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

from ...config import ParallelConfig
from ..shape import ModelShape
from ..cluster.stack import STACKS

__all__ = ["RUNS_2024", "runs", "zero3_2021"]

RUNS_2024 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs_2024.json")
"""Path of the published runs of today's stacks (data, sources, derivations)."""

_COMPILED = dataclasses.replace(STACKS["torchtitan"], name="torchtitan+compile", elementwise="fused",
                                source="torchtitan with torch.compile: FSDP2, SDPA flash attention, the elementwise "
                                       "ops compiled into fused kernels")
_FOUNDRY = dataclasses.replace(STACKS["torchtitan"], name="llm-foundry", checkpoint="whole",
                               source="llm-foundry (MosaicML): FSDP FULL_SHARD with prefetch, FlashAttention, eager "
                                      "PyTorch LayerNorm and GELU; activation checkpointing through Composer's "
                                      "FSDP wrapper, reentrant by default (activation_checkpointing_reentrant): "
                                      "the whole forward again")


@functools.lru_cache(maxsize=1)
def _load() -> tuple:
    with open(RUNS_2024) as fh:
        return tuple(json.load(fh))


def _hardware(run: dict) -> str:
    gpu = run["hardware"]["gpu"]
    if gpu.startswith("A100"):
        return "8xA100-80GB"
    return "8xH100-96GB-500W" if run["name"].startswith("torchtitan") else "8xH100-SXM"


def _stack(run: dict):
    if run["name"].startswith("torchtitan"):
        return _COMPILED if run["layout"].get("torch_compile") else STACKS["torchtitan"]
    if run["name"].startswith("Megatron-Core"):
        return STACKS["megatron-core"]
    return _FOUNDRY


def _config(run: dict) -> ParallelConfig:
    lay = run["layout"]
    dp, tp, pp = lay["dp"], lay["tp"], lay["pp"]
    rows = lay["microbatch"] or 1  # Megatron-Core's README: not stated, one sequence
    m = lay["global_batch"] // (dp * rows)
    recompute = {None: "none", "none": "none"}.get(lay["activation_checkpointing"], lay["activation_checkpointing"])
    return ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=m, zero=lay["zero"], precision="bf16",
                          recompute=recompute, sp_mode="split_gather" if tp > 1 else "ring")


def _shape(run: dict) -> ModelShape:
    m = run["model"]
    return ModelShape(layers=m["layers"], hidden=m["hidden"], heads=m["heads"], vocab=m["vocab"], seq=m["seq"],
                      ffn=m["ffn"], kv_heads=m["kv_heads"] if m["kv_heads"] != m["heads"] else 0, gated=m["gated"],
                      tied=m["tied"], positions=False, name=m["name"])


def runs() -> list[dict]:
    """Each published run: ``name``, ``shape``, ``config``, ``batch``, ``hardware`` (a preset name), ``stack``,
    ``published`` (seconds a step, the source's throughput turned into seconds), ``source``, ``confidence``,
    ``unknowns``."""
    out = []
    for r in _load():
        if r.get("kind") != "run":
            continue
        out.append({"name": r["name"], "shape": _shape(r), "config": _config(r), "batch": r["layout"]["global_batch"],
                    "hardware": _hardware(r), "stack": _stack(r), "published": r["step_seconds"],
                    "source": r["source"], "confidence": r["confidence"], "unknowns": r.get("unknowns", [])})
    return out


def zero3_2021() -> dict:
    """Megatron-LM's Table 2 (DeepSpeed ZeRO-3 against PTD-P, 175B and 530B on A100s) as recorded, with
    DeepSpeed's collectives of 2021 (``deepspeed_zero3_mechanism``)."""
    doc = {r["kind"]: r for r in _load() if r.get("kind") != "run"}
    return {"table": doc["zero3_2021"], "mechanism": doc.get("deepspeed_zero3_mechanism", {})}

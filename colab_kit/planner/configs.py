"""The local plan's candidates: every config ``boost`` runs for a model on ``world_size`` ranks and whose batch
splits (``enumerate_configs``; the mixture of experts adds its ep degrees in ``moe.local.moe_configs``).

dp, tp in four modes (1D, 2D for a square, 2.5D for a depth times a square, 3D for a cube), pp with every
schedule and a few microbatch counts, ring / Ulysses / split_gather, ZeRO 0-3, offload none / cpu (and 'auto'
when asked), recomputation none / selective / per-op / full; each judged by every part's rule over the
model's facts (``engine.parts.first_refusal``: the question ``boost`` asks)."""
from __future__ import annotations

import itertools
import math

from ..config import ConfigError, ParallelConfig
from ..engine.facts import ModelFacts
from ..engine.parts import first_refusal

__all__ = ["enumerate_configs"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _tensor_modes(tp: int):
    yield "1d", 1
    if tp > 1 and math.isqrt(tp) ** 2 == tp:
        yield "2d", 1
    for d in _divisors(tp)[1:]:
        if tp // d > 1 and math.isqrt(tp // d) ** 2 == tp // d:
            yield "2.5d", d
    q = round(tp ** (1 / 3))
    if tp > 1 and q ** 3 == tp:
        yield "3d", 1


def _pipelines(pp: int):
    if pp == 1:
        yield from (("1f1b", 1, m) for m in (1, 2))
        return
    for m in (pp, 2 * pp):
        for s in ("gpipe", "1f1b", "zb-h1"):
            yield s, 1, m
        yield "interleaved", 2, m
        yield "zb-v", 2, m


_RECOMPUTES = (("none", "op", "full"), ("none", "selective", "op", "full"))
"""Recompute candidates: selective where it recomputes something (the ring already recomputes its core);
per-op ("op") everywhere the engine runs it (not 2D / 2.5D: ``ParallelConfig`` refuses those)."""


def enumerate_configs(model, world_size: int, batch: int, precision: str = "fp32", with_auto: bool = False,
                      accept=None, facts: ModelFacts | None = None):
    """Every config boost runs for this model and batch on ``world_size`` ranks (see the module docstring).
    ``facts``: what the rules judge each config by (default: the ``GPTConfig`` ``model``'s, at its ``seq_len``);
    ``accept(cfg)``: a further check that raises ConfigError."""
    facts = facts if facts is not None else ModelFacts.of(model, seq=model.seq_len)
    for tp, sp, pp in itertools.product(_divisors(world_size), repeat=3):
        if world_size % (tp * sp * pp):
            continue
        dp = world_size // (tp * sp * pp)
        for (mode, depth), sp_mode, (schedule, chunks, m) in itertools.product(
                _tensor_modes(tp), ("ring", "ulysses") if sp > 1 else ("ring", "split_gather") if tp > 1 else ("ring",),
                _pipelines(pp)):
            recomputes = _RECOMPUTES[sp_mode != "ring" or sp == 1]
            for zero, offload, recompute in itertools.product((0, 1, 2, 3) if dp * sp > 1 else (0,),  # dp x sp
                                                              ("none", "cpu", "auto"), recomputes):
                if (offload == "auto" and not with_auto) or (offload != "none" and zero == 0):
                    continue
                try:
                    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, sp=sp, tp_mode=mode, tp_depth=depth, sp_mode=sp_mode,
                                         zero=zero, offload=offload, microbatches=m, schedule=schedule, chunks=chunks,
                                         precision=precision, recompute=recompute)
                    if first_refusal(cfg, facts) is not None:
                        continue
                    if accept is not None:
                        accept(cfg)
                except ConfigError:
                    continue
                shards = {"1d": 1, "2d": cfg.tp_q, "2.5d": depth * cfg.tp_q, "3d": cfg.tp_q ** 2}[mode]
                if batch % (dp * m) or (batch // (dp * m)) % shards:
                    continue
                yield cfg

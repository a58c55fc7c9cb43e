"""The parallel parts in one ordered tuple: each part's name, whether a config wants it, what it refuses, and
its step of ``ck.parallelize``. The order is written here and nowhere else.

Each entry is a ``colab_kit.part.Part`` (its name, whether a config wants it, its rules, its step of
``ck.parallelize`` and its hooks in the training step), declared in the part's own folder
(``colab_kit/<part>/part.py``: ``PART`` and its ``RULES``); the engine's own steps (defer_init, materialize,
placements, broadcast) are declared here. ``parallelize`` is a loop over ``PARTS``: each part whose ``apply``
exists and that the config wants runs, in order, and its name goes to ``Parallelized.steps``; ``plan_steps(config)``
lists the same names without a model. The "policy" part has rules and no step (``check_policy`` prepares the model
before ``parallelize``). ``first_refusal(config, facts)`` asks every part's rules: first what this version of the
engine does not run yet (``NotYet``, every part, in one sentence), then each part's other rules in the parts'
order; ``boost`` and the planner ask the same question.

Adding a part: its folder (its code and a ``part.py`` declaring ``PART``) and one line in ``PARTS``. Worked
example, ``ParallelConfig(dp=2, tp=2, pp=2)``::

    >>> from colab_kit import ParallelConfig
    >>> plan_steps(ParallelConfig(dp=2, tp=2, pp=2))
    ('defer_init', 'tensor', 'pipeline_split', 'materialize', 'placements', 'broadcast', 'data_parallel')
    >>> [p.name for p in PARTS if p.apply is None]
    ['policy']
    >>> str(part("tensor").refuses(ParallelConfig(tp=8), ModelFacts.of(_EXAMPLE)))[:28]   # a 4-head GPT
    'n_heads=4 not divisible by 8'
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from .. import comm
from ..config import Axis, ConfigError, ParallelConfig
from ..dropout.part import PART as DROPOUT
from ..expert.part import PART as EXPERT
from ..models import GPTConfig
from ..part import HOOKS, Build, NotYet, Part, Rule, broken, sentence
from ..pipeline.part import PART as PIPELINE_SPLIT
from ..pipeline.stage import defer_stages
from ..placement import PlacementTable, Replicate
from ..policy.hf import converted_conv1d, without_kv_cache
from ..policy.part import PART as POLICY
from ..precision.part import PART as PRECISION
from ..recompute.part import PART as RECOMPUTE
from ..sequence.part import PART as SEQUENCE
from ..sharded_init import materialize, meta_twin
from ..tensor import sync_grads
from ..tensor.part import PART as TENSOR
from ..zero.part import PART as DATA_PARALLEL
from ..zero.stage0 import reduction_axis
from .facts import ModelFacts

__all__ = ["Build", "HOOKS", "PARTS", "Part", "first_refusal", "hooks", "not_yet", "part", "plan_steps", "refusals"]

_EXAMPLE = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4)


# ---------------------------------------------------------------------------------------------- the steps
def _defer_init(b: Build) -> None:  # only this rank's shards are made, later
    b.twin, b.conv1d = meta_twin(b.model), tuple(converted_conv1d(b.model))  # before anything changes the model
    b.deferred = defer_stages(b.model, b.config, b.mesh.rank(Axis.PP), b.policy)
    without_kv_cache(b.model)


def _materialize(b: Build) -> None:
    """What is still meta, one tensor at a time (under ZeRO-3 the trainable ones stay meta: its chunks make only
    this rank's piece of each), on the mesh's device."""
    zero3 = b.config.zero == 3 and b.deferred
    keep = (lambda t: isinstance(t, nn.Parameter) and t.requires_grad) if zero3 else None
    device = b.mesh.device
    b.module = materialize(b.model, keep)._apply(lambda t: t if t.is_meta else t.to(device))
    b.n_local = sum(p.numel() for p in b.module.parameters() if p.requires_grad)


def _placements(b: Build) -> None:  # as each layer declared it
    b.table = PlacementTable(b.module)


INIT_BUCKET_BYTES = 32 << 20
"""How many bytes of parameters one start-up broadcast carries at most (``_broadcast``)."""


def _broadcast(b: Build) -> None:
    """One start even if a seed differed: every parameter this rank made is overwritten with its group's first
    rank's (over dp x sp, the ranks data parallelism reduces over, ``zero.reduction_axis``; over edp for an
    expert's piece under ep), several parameters per broadcast, as DDP syncs a
    module's states: flattened per (axis, dtype), sent, copied back. A bucket holds at most the largest parameter
    this rank holds (and never more than ``INIT_BUCKET_BYTES``), so the copy adds no more to the start-up peak
    than one parameter, which sharded initialisation already allows itself (one whole parameter at a time); a
    parameter that size or larger goes alone, in place. Meta parameters (made later by ZeRO-3 from its recipe,
    the same on every rank) are skipped.

    Worked example, dp=2 on tests' 4-block GPT (53 parameters, 55,488 floats; the largest, an MLP weight, 4,096):
    15 broadcasts tagged "init params" instead of 53, each at most 16 KiB (the 8 MLP weights alone, the rest
    shared); rank 1's parameters then hold rank 0's values."""
    made = [p for p in b.module.parameters() if not p.is_meta]
    if not made:
        return
    cap = min(INIT_BUCKET_BYTES, max(p.numel() * p.element_size() for p in made))
    buckets: dict[tuple, tuple[int, list[torch.Tensor]]] = {}  # (axis, dtype, device) -> (bytes, tensors)
    with torch.no_grad():  # smallest first, so that the small ones share buckets (the same order on every rank)
        for nbytes, _, p in sorted((p.numel() * p.element_size(), i, p) for i, p in enumerate(made)):
            axis = Axis.EDP if b.config.ep > 1 and b.table[p].on(Axis.EP) != Replicate() else reduction_axis(b.config)
            if b.mesh.size(axis) == 1:
                continue
            key = (axis, p.dtype, p.device)
            filled, tensors = buckets.get(key, (0, []))
            if tensors and filled + nbytes > cap:  # the bucket would outgrow one parameter: send it first
                _send_bucket(b, axis, tensors)
                filled, tensors = 0, []
            buckets[key] = (filled + nbytes, tensors + [p.data])
        for (axis, _, _), (_, tensors) in buckets.items():  # in the order they began, the same on every rank
            _send_bucket(b, axis, tensors)


def _send_bucket(b: Build, axis: str, tensors: list[torch.Tensor]) -> None:
    if len(tensors) == 1:
        comm.broadcast(tensors[0], b.mesh, axis, tag="init params")
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.broadcast(flat, b.mesh, axis, tag="init params")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


# ---------------------------------------------------------------------------------------------- the step's hooks
def _sum_replicated(step, masters) -> None:
    """Gradients of what the tensor plan keeps whole on each of its ranks, summed over those axes (after the
    dp reduction: sums over different groups commute); with ZeRO or fp32 masters on this rank's reduced
    pieces. The sequence plan's sums over sp are made by the dp reduction itself, over ``dp_sp``
    (``zero.reduction_axis``)."""
    if step.parts.tp_plan is None and step.parts.sp_plan is None:
        return
    if step.config.zero or masters is not None:
        step.data_parallel.sync_replicated()
    else:
        sync_grads(step.parts.module, step.mesh, step.parts.placement_table, skip=step.data_parallel.folds)


PARTS: tuple[Part, ...] = (
    POLICY,
    Part("defer_init", apply=_defer_init),
    DROPOUT,
    TENSOR,
    SEQUENCE,
    EXPERT,
    RECOMPUTE,
    PIPELINE_SPLIT,
    Part("materialize", apply=_materialize),
    Part("placements", apply=_placements, hooks={"finish_grads": _sum_replicated}),
    Part("broadcast", apply=_broadcast),
    PRECISION,
    DATA_PARALLEL,
)
"""Every part, in the order ``parallelize`` takes their steps (and ``first_refusal`` asks their rules)."""

_ORDER = tuple((p, r) for first in (True, False) for p in PARTS for r in p.rules if r.not_yet == first)
_RULES = tuple(r for _, r in _ORDER)
_PART_OF = {r: p for p, r in _ORDER}


def hooks(stage: str) -> tuple[tuple[str, Callable], ...]:
    """``(part, function)`` of every part's hook at ``stage`` (one of ``HOOKS``), in the parts' order."""
    return _HOOKS[stage]


_HOOKS = {h: tuple((p.name, p.hooks[h]) for p in PARTS if h in p.hooks) for h in HOOKS}


def plan_steps(config: ParallelConfig, *, dropout: bool = False) -> tuple[str, ...]:
    """The steps ``parallelize`` takes for ``config`` (``dropout``: the model has dropout), in order."""
    return tuple(p.name for p in PARTS if p.apply is not None and p.wants(config, dropout))


def part(name: str) -> Part:
    """The part called ``name`` (``part("expert").refuses(config, facts)``)."""
    return next(p for p in PARTS if p.name == name)


def refusals(config: ParallelConfig, facts: ModelFacts | None = None) -> Iterator[tuple[Part, Rule, str]]:
    """``(part, rule, message)`` of every rule ``config`` breaks, in ``first_refusal``'s order."""
    for r, why in broken(_RULES, config, facts):
        yield _PART_OF[r], r, sentence([why]) if isinstance(why, NotYet) else why


def not_yet(config: ParallelConfig, facts: ModelFacts | None = None) -> str | None:
    """What this version of the engine does not run of ``config`` (for the model of ``facts``), in one sentence
    with what to set instead, or None (``engine.unsupported``)."""
    items = [why for r, why in broken(_RULES, config, facts) if r.not_yet]
    return sentence(items) if items else None


def first_refusal(config: ParallelConfig, facts: ModelFacts | None = None) -> ConfigError | None:
    """The ConfigError ``boost`` raises for ``config`` and the model of ``facts`` before any process starts (the
    rule broken and a value that works), or None where every part takes it."""
    for _, why in broken(_RULES, config, facts):
        return ConfigError(not_yet(config, facts) if isinstance(why, NotYet) else why)
    return None

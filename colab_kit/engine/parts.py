"""The parallel parts in one ordered tuple: each part's name, whether a config wants it, what it refuses, and
its step of ``ck.parallelize``. The order is written here and nowhere else.

A ``Part`` is ``name``, ``wants(config, dropout) -> bool`` (``dropout``: the model has dropout), ``rules`` (what
it refuses given a config and the model's facts: ``engine.rules``) and ``apply(build)``, the step that changes
``build`` (a ``Build``: the model and what the steps before left for the ones after). ``parallelize`` is a loop
over ``PARTS``: each part whose ``apply`` exists and that the config wants runs, in order, and its name goes to
``Parallelized.steps``; ``plan_steps(config)`` lists the same names without a model. The "policy" part has
rules and no step (``check_policy`` prepares the model before ``parallelize``). ``first_refusal(config, facts)``
asks every part's rules: first what this version of the engine does not run yet (``NotYet``, every part, in one
sentence), then each part's other rules in the parts' order; ``boost`` and the planner ask the same question.

Adding a part: its folder (``colab_kit/<part>/apply.py`` with the ``apply_<what>`` it runs, its rules in
``engine/rules/<part>.py``) and one entry here. Worked example, ``ParallelConfig(dp=2, tp=2, pp=2)``::

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .. import comm
from ..config import ConfigError, ParallelConfig
from ..dropout.apply import apply_dropout
from ..expert.apply import apply_expert_parallel
from ..models import GPTConfig
from ..models.moe import update_router_bias
from ..pipeline.apply import apply_pipeline_split
from ..pipeline.stage import defer_stages
from ..placement import PlacementTable, Replicate
from ..policy.hf import converted_conv1d
from ..precision.apply import apply_precision
from ..recompute.apply import apply_recompute
from ..sequence.apply import apply_sequence_parallel
from ..sharded_init import materialize, meta_twin
from ..tensor import sync_grads
from ..tensor.apply import apply_tensor_parallel
from ..zero.apply import apply_data_parallel
from .facts import ModelFacts
from .rules import expert, pipeline, policy, sequence, tensor, zero
from .rules.base import NotYet, Rule, sentence

__all__ = ["Build", "HOOKS", "PARTS", "Part", "first_refusal", "hooks", "not_yet", "part", "plan_steps", "refusals"]

_EXAMPLE = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4)


@dataclass
class Build:
    """What ``parallelize``'s steps hand each other on one rank: the model as the steps before left it, the
    plans they made, and, from ``materialize`` on, the ``module`` this rank runs."""

    model: nn.Module
    mesh: Any
    config: ParallelConfig
    policy: Any
    loss: Callable
    token_loss: Any = None
    bucket_bytes: int | None = None
    device_budget: int | None = None
    group_of_name: Callable[[str], int] | None = None
    twin: Any = None  # the dense model on meta (defer_init)
    conv1d: tuple = ()
    deferred: bool = False
    undo: list = field(default_factory=list)
    tp_plan: Any = None
    sp_plan: Any = None
    stages: list | None = None
    tied: list = field(default_factory=list)
    module: Any = None  # the nn.Module this rank runs (materialize on)
    n_local: int = 0
    table: Any = None  # the PlacementTable (placements on)
    events: list = field(default_factory=list)
    grads: Any = None
    steps: list = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class Part:
    """One parallel part (module docstring)."""

    name: str
    wants: Callable[[ParallelConfig, bool], bool] = lambda config, dropout: True
    rules: tuple[Rule, ...] = ()
    apply: Callable[[Build], None] | None = None
    hooks: dict = field(default_factory=dict)
    """This part's work in the training step (``engine.step``), by stage: ``HOOKS``' names to a function of the
    ``TrainingStep`` and the stage's value; each decides from the step whether it has work this time."""

    def refuses(self, config: ParallelConfig, facts: ModelFacts | None = None) -> ConfigError | None:
        """The first of this part's rules that ``config`` breaks for the model of ``facts``, or None."""
        for r in sorted(self.rules, key=lambda r: not r.not_yet):
            if r.model and facts is None:
                continue
            why = r.check(config, facts)
            if why is not None:
                return ConfigError(sentence([why]) if isinstance(why, NotYet) else why)
        return None


# ---------------------------------------------------------------------------------------------- the steps
def _defer_init(b: Build) -> None:  # only this rank's shards are made, later
    b.twin, b.conv1d = meta_twin(b.model), tuple(converted_conv1d(b.model))  # before anything changes the model
    b.deferred = defer_stages(b.model, b.config, b.mesh.rank("pp"), b.policy)
    hf = getattr(b.model, "config", None)  # a training step reads no KV cache; a recomputed forward would append
    if hf is not None and getattr(hf, "use_cache", False):  # its keys to it a second time
        hf.use_cache = False


def _dropout(b: Build) -> None:  # masks from global coordinates
    b.undo = apply_dropout(b.model, b.policy)


def _tensor(b: Build) -> None:  # this rank's blocks of each matrix
    b.model, b.tp_plan = apply_tensor_parallel(b.model, b.mesh, b.config, b.policy, b.token_loss)


def _sequence(b: Build) -> None:  # attention on this rank's tokens
    b.model, b.sp_plan = apply_sequence_parallel(b.model, b.mesh, b.config, b.policy)


def _expert(b: Build) -> None:  # this rank's experts, tokens sent to them
    apply_expert_parallel(b.model, b.mesh, b.config, b.policy)


def _recompute(b: Build) -> None:  # blocks (or attention cores) recompute in backward
    apply_recompute(b.model, b.policy, b.config, b.sp_plan)


def _pipeline_split(b: Build) -> None:  # this rank's stages
    b.stages, b.tied = apply_pipeline_split(b.model, b.mesh, b.config, b.policy)
    b.model = nn.ModuleList(b.stages)


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


def _broadcast(b: Build) -> None:  # one start even if a seed differed; experts over the ranks holding the same
    with torch.no_grad():
        for p in b.module.parameters():
            if p.is_meta:  # made by ZeRO-3 from its recipe: the same values on every rank
                continue
            axis = "edp" if b.config.ep > 1 and b.table[p].on("ep") != Replicate() else "dp"
            comm.broadcast(p.data, b.mesh, axis, tag="init params")


def _precision(b: Build) -> None:  # a 16-bit model, the loss in fp32
    b.loss = apply_precision(b.module, b.config, b.loss)


def _data_parallel(b: Build) -> None:  # dp or ZeRO 1-3: gradient sync and what the optimizer steps
    b.grads = apply_data_parallel(b.module, b.mesh, b.config, b.policy, b.table, b.events,
                                  bucket_bytes=b.bucket_bytes, device_budget=b.device_budget,
                                  group_of_name=b.group_of_name)


# ---------------------------------------------------------------------------------------------- the step's hooks
def _aux_losses(step, local):  # this rank's share of the auxiliary losses: their mean over ranks is one process's
    return local + step.aux_value() if step.moe else local


def _sum_tied(step, masters) -> None:
    """A weight the first and the last pipeline stage share (a head tied to the token table) has a copy on each
    of their ranks, each with the gradient of its own use: sum them over pp (the ranks between contribute
    zeros), so both copies take the same step and stay equal (Megatron's way)."""
    for shape, p in step.parts.tied:
        if p is None:  # the gradient's dtype: the fp32 masters', else the model's
            dtype = torch.float32 if masters is not None else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                               "fp16": torch.float16}[step.config.precision]
            g = torch.zeros(shape, dtype=dtype, device=step.mesh.device)
        elif masters is not None:
            master = masters.params[next(i for i, t in enumerate(masters.model) if t is p)]
            if master.grad is None:
                raise RuntimeError("a tied weight's fp32 master has no gradient after grads.finish()")
            g = master.grad
        else:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = g
        comm.all_reduce(g, step.mesh, "pp", tag="tied grads")


def _sum_replicated(step, masters) -> None:
    """Gradients of what the tensor or sequence plan keeps whole on each of its ranks, summed over those axes
    (after the dp reduction: sums over different groups commute); with ZeRO or fp32 masters on this rank's
    reduced pieces."""
    if step.parts.tp_plan is None and step.parts.sp_plan is None:
        return
    if step.config.zero or masters is not None:
        step.grads.sync_replicated()
    else:
        sync_grads(step.parts.module, step.mesh, step.parts.placement_table)


def _router_bias(step, done) -> None:  # DeepSeek's bias, from the step's load (the same on every dp rank)
    if step.moe:  # kept on a skipped step
        update_router_bias(step.parts.module, skip=done["skipped"])


def _gather_params(step, done) -> None:  # ZeRO: the updated pieces all-gathered back into the parameters
    if step.config.zero and not done["skipped"]:
        with step.timed("all_gather params", "comm"):
            step.grads.gather_params()


def _place_chunks(step, done) -> None:  # offload='auto': the first step measured, the chunks are placed now
    if step.grads.placement is not None:
        step.grads.placement.after_step(next_activations=step.activation_reserve())


HOOKS = ("loss", "finish_grads", "after_optimizer", "after_step")
"""The training step's stages where parts work (``engine.step.TrainingStep._end``), in the step's order: "loss"
(``(step, local) -> local``: terms the reported loss adds), "finish_grads" (``(step, masters)``: after the
gradient sync, before the optimizer), "after_optimizer" (``(step, done)``), "after_step" (``(step, done)``: after
the loss is reduced)."""


PARTS: tuple[Part, ...] = (
    Part("policy", rules=policy.RULES),
    Part("defer_init", apply=_defer_init),
    Part("dropout", lambda c, dropout: dropout, apply=_dropout),
    Part("tensor", lambda c, _: c.tp > 1, tensor.RULES, _tensor),
    Part("sequence", lambda c, _: c.sp > 1, sequence.RULES, _sequence),
    Part("expert", lambda c, _: c.ep > 1, expert.RULES, _expert,
         {"loss": _aux_losses, "after_optimizer": _router_bias}),
    Part("recompute", lambda c, _: c.recompute != "none", apply=_recompute),
    Part("pipeline_split", lambda c, _: c.pp > 1, pipeline.RULES, _pipeline_split, {"finish_grads": _sum_tied}),
    Part("materialize", apply=_materialize),
    Part("placements", apply=_placements, hooks={"finish_grads": _sum_replicated}),
    Part("broadcast", apply=_broadcast),
    Part("precision", lambda c, _: c.precision != "fp32", apply=_precision),
    Part("data_parallel", rules=zero.RULES, apply=_data_parallel,
         hooks={"after_optimizer": _gather_params, "after_step": _place_chunks}),
)
"""Every part, in the order ``parallelize`` takes their steps (and ``first_refusal`` asks their rules)."""

_ORDER = tuple((p, r) for first in (True, False) for p in PARTS for r in p.rules if r.not_yet == first)


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
    for p, r in _ORDER:
        if r.model and facts is None:
            continue
        why = r.check(config, facts)
        if why is not None:
            yield p, r, sentence([why]) if isinstance(why, NotYet) else why


def not_yet(config: ParallelConfig, facts: ModelFacts | None = None) -> str | None:
    """What this version of the engine does not run of ``config`` (for the model of ``facts``), in one sentence
    with what to set instead, or None (``engine.unsupported``)."""
    items = [why for _, r in _ORDER if r.not_yet and not (r.model and facts is None)
             for why in (r.check(config, facts),) if why is not None]
    return sentence(items) if items else None


def first_refusal(config: ParallelConfig, facts: ModelFacts | None = None) -> ConfigError | None:
    """The ConfigError ``boost`` raises for ``config`` and the model of ``facts`` before any process starts (the
    rule broken and a value that works), or None where every part takes it."""
    for _, r in _ORDER:
        if r.model and facts is None:
            continue
        why = r.check(config, facts)
        if why is not None:
            return ConfigError(not_yet(config, facts) if isinstance(why, NotYet) else why)
    return None

"""The at-scale search of ``ck.plan(..., hardware=<preset>)``: thousands of GPUs planned in seconds.

Every config the engine runs for ``gpus`` ranks is a candidate; the search prices as few of them as it can
(``price`` is the at-scale cost model, ``memory_of`` the engine's memory estimate) by pruning, in order:

1. **shapes the model cannot take**: tp must divide the heads (and the hidden size), pp the layers
   (interleaved: pp x chunks), sp the sequence (Ulysses: the heads per tp rank too), dp x microbatches
   the batch; what ``boost`` refuses, every part's rule for the model's facts (``engine.rules.first_refusal``:
   ZeRO-3 with a pipeline, sizes a tensor mode cannot split, a Llama under split_gather, ...).
2. **what cannot fit**: the model states of a (tp, pp, dp, zero) alone (params, grads and optimizer of the
   fullest stage, ``memory.formulas.model_state_bytes``) above the device's usable bytes: none of its
   microbatch sizes, schedules or recomputations is looked at.
3. **what is dominated**: gpipe holds every microbatch where 1F1B holds pp of them at the same bubble, so
   only 1F1B, interleaved and the zero-bubble schedules are priced; for one layout, schedule and
   microbatch size, a more thorough recomputation (none < selective < op < full) only saves memory at a time
   cost, so only the least one that fits is priced at each ZeRO stage; offload is left out (it moves the
   optimizer over PCIe, slower than any layout that fits without it; plan with ``restrict={"offload":
   ("cpu",)}`` to see it).

Then branch and bound (``search``): the configs in the order of a lower bound on their step time, each priced
in full until the ``limit``-th candidate found beats the next bound. A layout's configs are not even built
until the search reaches the layout's floor (``cluster.price.compute_floor``: its compute and tensor / sequence
traffic), and most layouts never are.

Worked example (175B, 1,536 A100s, the Megatron-LM Table 1 setting)::

    >>> import colab_kit as ck
    >>> from colab_kit.models import GPTConfig
    >>> gpt3 = GPTConfig(vocab_size=51200, seq_len=2048, d_model=12288, n_heads=96, n_layers=96)
    >>> cands = ck.plan(gpt3, 1536, batch=1536, precision="fp16", hardware="8xA100-80GB")  # doctest: +SKIP
    >>> print(cands.table(3))                                                             # doctest: +SKIP
      #  config                                                       fits  GiB/rank    states      acts   s/step
      0  dp=768 x tp=2 (1d) zero=3 split_gather op-recompute          yes      42.80      1.70     41.10    9.998
      1  dp=1536 zero=3 op-recompute                                  yes      42.75      1.70     41.05   10.127
      2  dp=768 x sp=2 zero=3 ring op-recompute                       yes      38.18      1.70     36.48   10.137
    3 of 10 candidates; memory_per_rank 72,778,774,528 B; estimates (GiB on the device per rank)
    (the MFU and why columns left out here)

Planned in under 2 s on a 2-core machine: bench/plan_scale.py, whose docstring says where the time goes.
Within what Megatron-LM could choose in 2021 (``restrict=planner.published.PUBLISHED_SPACE``,
``hardware=planner.published.MEGATRON_2021``) the first choice is dp=32 x pp=12 x tp=4 interleaved with full
recomputation at 18.0 s, and Megatron's tp=8 x pp=8 x dp=24 is estimated at 20.6 s (docs/planner.md,
"Against Megatron-LM's Table 1").
"""
from __future__ import annotations

import bisect
import copy
import heapq
import math
from collections.abc import Iterator
from operator import attrgetter

from ..config import Axis, ConfigError, ParallelConfig
from ..engine.facts import ModelFacts
from ..engine.parts import first_refusal
from ..memory.formulas import model_state_bytes
from .candidates import Candidate, Candidates
from .estimate import Estimate, gpt_of, memory_of, priced
from .cluster.hardware import Hardware
from .cluster.price import compute_floor, price
from .moe import price as moe_price
from .shape import ModelShape, shape_and_facts

__all__ = ["search", "layouts", "plan_at_scale", "RECOMPUTE"]

RECOMPUTE = ("none", "selective", "op", "full")
"""Least to most recomputation: what the search tries in turn until the activations fit (per-op selective, "op",
keeps about half of a block's activations at the cost of every second matmul: between selective and full)."""


_seconds = attrgetter("step_seconds")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _allowed(restrict: dict, key: str, value) -> bool:
    """Whether ``restrict`` (ParallelConfig field -> a value or a tuple of values) lets ``key`` be ``value``."""
    if key not in restrict:
        return True
    want = restrict[key]
    return value in want if isinstance(want, (tuple, list, set, frozenset)) else value == want


def _tensor_modes(tp: int) -> Iterator[tuple[str, int, str]]:
    """(tp_mode, tp_depth, sp_mode) for a tensor-parallel degree: 1D with and without Megatron's sequence
    parallelism (split_gather), and 2D / 2.5D / 3D where tp is a square or a cube."""
    yield "1d", 1, "ring"
    if tp == 1:
        return
    yield "1d", 1, "split_gather"
    if math.isqrt(tp) ** 2 == tp:
        yield "2d", 1, "ring"
    for d in _divisors(tp)[1:]:
        if tp // d > 1 and math.isqrt(tp // d) ** 2 == tp // d:
            yield "2.5d", d, "ring"
    q = round(tp ** (1 / 3))
    if q ** 3 == tp:
        yield "3d", 1, "ring"


def _schedules(shape: ModelShape, pp: int, m: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    per_rank = shape.layers // pp
    yield "1f1b", 1
    yield "zb-h1", 1
    for v in _divisors(per_rank)[1:]:
        if v <= 8 and m % pp == 0:
            yield "interleaved", v
    if per_rank % 2 == 0:
        yield "zb-v", 2


def layouts(shape: ModelShape, gpus: int, restrict: dict | None = None) -> Iterator[tuple[int, int, int, int]]:
    """(dp, tp, pp, sp) of ``gpus`` ranks the model can take (step 1 of the module docstring)."""
    restrict = restrict or {}
    for tp in _divisors(gpus):
        if shape.heads % tp or shape.hidden % tp or not _allowed(restrict, "tp", tp):
            continue
        for pp in _divisors(gpus // tp):
            if pp > shape.layers or shape.layers % pp or not _allowed(restrict, "pp", pp):
                continue
            for sp in _divisors(gpus // (tp * pp)):
                if shape.seq % sp or sp > 64 or not _allowed(restrict, "sp", sp):
                    continue
                dp = gpus // (tp * pp * sp)
                if _allowed(restrict, "dp", dp):
                    yield dp, tp, pp, sp


def _states_fit(shape: ModelShape, dp: int, tp: int, pp: int, zero: int, precision: str, optimizer: str,
                usable: int, sp: int = 1) -> bool:
    """Whether the fullest stage's model states alone fit (step 2): its blocks split over tp, the token
    table (first stage) or the head (last) too, ZeRO's shards over dp x sp; a mixture of experts' MoE layers
    whole on every tp rank, its experts over the largest ep of dp x sp and their states over edp."""
    per_stage = shape.layers // pp * shape.block_params() + shape.vocab * shape.hidden * (1 if pp > 1 else 2)
    if shape.experts:  # the dense part of its blocks; the experts as few as the largest ep leaves, over edp
        ep = max(_eps(shape, dp * sp))
        dense, experts = moe_price.params_split(shape, ParallelConfig(dp=dp, tp=tp, pp=pp, sp=sp, ep=ep),
                                                shape.layers // pp)
        both = [model_state_bytes(math.ceil(dense), optimizer, precision, dp * sp, zero),
                model_state_bytes(math.ceil(experts), optimizer, precision, dp * sp // ep, zero)]
        return sum(sum(s.values()) for s in both) <= usable
    states = model_state_bytes(math.ceil(per_stage / tp), optimizer, precision, dp * sp, zero)
    return sum(states.values()) <= usable


def _eps(shape: ModelShape, fold: int, restrict: dict | None = None) -> list[int]:
    """Expert-parallel degrees of a mixture of experts: divisors of dp x sp that divide its experts."""
    if not shape.experts:
        return [1]
    return [e for e in _divisors(fold) if shape.experts % e == 0 and _allowed(restrict or {}, "ep", e)] or [1]


def _modes(shape, dp, tp, pp, sp, batch) -> Iterator[tuple[int, str, int, tuple[str, ...]]]:
    """(microbatches, tp_mode, tp_depth, sp_modes) of a layout's configs, each taken with every schedule
    (``_configs``; ``_floor``, which needs no schedule). With sp > 1 the sequence is split by ring or Ulysses,
    so 1D's split_gather entry of ``_tensor_modes`` is skipped (it would give the same configs twice)."""
    rows = batch // dp
    for mbs in _divisors(rows):
        m = rows // mbs
        if mbs > 32 or (pp > 1 and m < pp) or (pp == 1 and mbs < rows and mbs > 1 and m > 64):
            continue
        for (mode, depth, sp_mode) in _tensor_modes(tp):
            if sp > 1 and sp_mode == "split_gather":
                continue
            modes = ("ring", "ulysses") if sp > 1 else (sp_mode,)
            yield m, mode, depth, tuple(s for s in modes if s != "ulysses" or (shape.heads // tp) % sp == 0)


def _configs(shape, dp, tp, pp, sp, batch, precision, restrict, facts: ModelFacts, zero: int = 0,
             recompute: str = "none") -> Iterator[ParallelConfig]:
    """Configs of one layout at ``zero`` and ``recompute`` (the search varies those two afterwards); one that
    comes twice (``_modes``) is built once."""
    if batch % dp:
        return
    eps = _eps(shape, dp * sp, restrict)
    built: dict[tuple, list[ParallelConfig]] = {}
    for m, mode, depth, sp_modes in _modes(shape, dp, tp, pp, sp, batch):
        for sched, chunks in _schedules(shape, pp, m):
            for spm in sp_modes:
                key = (mode, depth, spm, m, sched, chunks)
                if key in built:
                    yield from built[key]
                    continue
                got = built[key] = []
                fields = dict(dp=dp, tp=tp, pp=pp, sp=sp, tp_mode=mode, tp_depth=depth, sp_mode=spm,
                              microbatches=m, schedule=sched, chunks=chunks, precision=precision)
                if restrict and not all(_allowed(restrict, k, v) for k, v in fields.items()):
                    continue
                fields.update(zero=zero, recompute=recompute)
                for ep in eps:
                    try:
                        cfg = ParallelConfig(**fields, ep=ep)
                    except ConfigError:
                        continue
                    if first_refusal(cfg, facts) is None:  # boost's own question (engine.rules)
                        got.append(cfg)
                        yield cfg


def _bound(shape, cfg, batch, hw, optimizer) -> float:
    """A lower bound on the step time of every (zero, recompute) variant of ``cfg`` (priced at zero 0 and its
    least recomputation): less recomputation and a lower ZeRO stage are never slower in the cost model,
    except the optimizer's step and the dp traffic, which ZeRO shards and reshapes, so those two are left out."""
    p = price(shape, cfg, batch, hw, seq=shape.seq, optimizer=optimizer)
    return p.step_seconds - p.breakdown.get("optimizer", 0.0) - p.breakdown.get("comm:dp", 0.0)


ZBV_MARGIN = 0.10
"""How far under the budget a zb-v config priced at unit costs must be to be taken as fitting without its fitted
plan: the V fitted to the model's FLOPs, as the engine runs it, holds up to 6% more than at unit costs
(``estimate.memory_of``; tests/unit/test_estimate.py), so one within 10% of the budget is walked fitted too, where
``pp x microbatches`` is at most ``SEARCH_FIT_ACTIONS`` (a mixture of experts' walk is at unit costs either way:
``memory.moe_shape.moe_memory``)."""

SEARCH_FIT_ACTIONS = 1024
"""The largest ``pp x microbatches`` the search fits a zb-v plan for (pp 8 and 128 microbatches: a tenth of a second;
pp 16 and 128, ``estimate.FIT_ACTIONS``, takes 0.4 s, a fifth of the 1T plan's time): a deeper V near the budget is
priced at unit costs, up to 6% short of what the engine's fitted plan holds; ``ck.estimate`` of the chosen config
walks it fitted."""


def _variants(shape, cfg, batch, hw, zeros, recomputes, optimizer, usable, gpt, offloads,
              facts: ModelFacts) -> list[Estimate]:
    """The (zero, offload, recompute) variants of ``cfg`` that fit and that no faster one beats on memory: for
    each ZeRO stage and offload the least recomputation that fits (more is only slower), then the time-memory
    Pareto front. Memory at unit costs (``memory_of(fit=False)``), a zb-v config within ``ZBV_MARGIN`` of the
    budget as the fitted plan the engine runs holds it (walked while ``pp x microbatches`` is at most
    ``SEARCH_FIT_ACTIONS``)."""
    fitting = []
    for zero, offload in ((z, o) for z in zeros for o in offloads):
        for rc in recomputes:
            try:
                c = cfg.replace(zero=zero, recompute=rc, offload=offload)
            except ConfigError:
                break
            if first_refusal(c, facts) is not None:
                break
            mem = memory_of(shape, c, batch, optimizer, gpt=gpt, fit=False)
            used = sum(mem["device"].values())
            if (c.schedule == "zb-v" and not shape.experts and c.pp * c.microbatches <= SEARCH_FIT_ACTIONS
                    and usable / (1 + ZBV_MARGIN) < used <= usable):  # the fitted V may not fit
                mem = memory_of(shape, c, batch, optimizer, gpt=gpt)
                used = sum(mem["device"].values())
            if used <= usable:
                fitting.append(priced(shape, c, batch, hw, mem, optimizer))
                break
    fitting.sort(key=lambda e: (e.step_seconds, sum(e.memory["device"].values())))
    front, least = [], None
    for e in fitting:
        used = sum(e.memory["device"].values())
        if least is None or used < least:
            front.append(e)
            least = used
    return front


def _floor(shape, dp, tp, pp, sp, batch, precision, hw, probes: dict) -> float:
    """A floor under ``_bound`` of every config ``_configs`` gives this layout: the least ``compute_floor`` of its
    microbatch counts and modes, less 1e-9 of it for rounding; -inf where there is none (a mixture of experts; a
    mode ``ParallelConfig`` refuses). ``probes``: a config of each mode, kept by the caller."""
    if shape.experts or batch % dp:
        return -math.inf
    best = math.inf
    for m, mode, depth, sp_modes in _modes(shape, dp, tp, pp, sp, batch):
        for spm in sp_modes:
            key = (tp, sp, mode, depth, spm)
            if key not in probes:
                try:
                    probes[key] = ParallelConfig(tp=tp, sp=sp, tp_mode=mode, tp_depth=depth, sp_mode=spm,
                                                 precision=precision)
                except ConfigError:
                    probes[key] = None
            floor = compute_floor(shape, probes[key], batch, dp, m, pp, hw) if probes[key] else -math.inf
            if not floor >= 0:  # -inf, or NaN
                return -math.inf
            best = min(best, floor)
    return best * (1 - 1e-9)


def search(shape: ModelShape, gpus: int, batch: int, hw: Hardware, *, precision: str, optimizer: str = "adamw",
           memory_per_rank: int | None = None, restrict: dict | None = None, limit: int = 10,
           lazy: bool = True, facts: ModelFacts | None = None) -> list[Estimate]:
    """The ``limit`` fastest candidates that fit, best first (see the module docstring for what is pruned).

    Branch and bound: every config is priced at its fastest variant (``_bound``) and taken in the order of that
    bound (ties: in the order ``layouts`` and ``_configs`` give them); its variants that fit are priced and kept;
    the search stops at the first config whose bound is slower than the ``limit``-th candidate found, which
    nothing after it can beat. A layout's configs are built and bounded only when the search reaches the
    layout's floor (``_floor``: none of them comes sooner), so most never are; ``lazy=False`` bounds every config
    first, to the same answer. A bound below its layout's floor (a cost model that ``compute_floor`` no longer
    follows) starts the search again without floors. ``facts``: what the engine's rules judge each config by
    (``engine.facts.ModelFacts``; default: the shape's own, ``ModelFacts.of(shape)``), read once per plan."""
    restrict = dict(restrict or {})
    facts = facts if facts is not None else ModelFacts.of(shape)
    usable = memory_per_rank if memory_per_rank is not None else hw.usable_bytes
    recomputes = [rc for rc in RECOMPUTE if _allowed(restrict, "recompute", rc)]
    offloads = [o for o in ("none", "cpu") if _allowed(restrict, "offload", o)] if "offload" in restrict else ["none"]
    gpt = gpt_of(shape)
    todo: list[tuple[float, int, tuple[int, int, int, int], list[int]]] = []  # (floor, place, layout, zeros)
    probes: dict[tuple, ParallelConfig | None] = {}
    for place, (dp, tp, pp, sp) in enumerate(layouts(shape, gpus, restrict)):
        zeros = [z for z in (0, 1, 2, 3) if (dp * sp > 1 or z == 0) and _allowed(restrict, "zero", z)
                 and _states_fit(shape, dp, tp, pp, z, precision, optimizer, usable, sp)]
        if not zeros or not recomputes:
            continue
        floor = _floor(shape, dp, tp, pp, sp, batch, precision, hw, probes) if lazy else -math.inf
        todo.append((floor, place, (dp, tp, pp, sp), zeros))
    todo.sort(key=lambda t: (t[0], t[1]))
    queue: list[tuple[float, int, int, ParallelConfig, list[int]]] = []  # a heap: (bound, place, i, config, zeros)
    out: list[Estimate] = []  # the ``limit`` fastest so far, in order (ties: first found first)
    done: dict[tuple, list[Estimate]] = {}  # a config that comes twice (``_configs``) is priced once, copied
    nxt = 0
    while True:
        while nxt < len(todo) and (not queue or todo[nxt][0] <= queue[0][0]):
            floor, place, (dp, tp, pp, sp), zeros = todo[nxt]
            nxt += 1
            for i, cfg in enumerate(_configs(shape, dp, tp, pp, sp, batch, precision, restrict, facts, zeros[0],
                                             recomputes[0])):
                bound = _bound(shape, cfg, batch, hw, optimizer)
                if bound < floor:
                    return search(shape, gpus, batch, hw, precision=precision, optimizer=optimizer,
                                  memory_per_rank=memory_per_rank, restrict=restrict, limit=limit, lazy=False,
                                  facts=facts)
                heapq.heappush(queue, (bound, place, i, cfg, zeros))
        if not queue:
            break
        bound, _, _, cfg, zeros = heapq.heappop(queue)
        if len(out) >= limit and bound > out[limit - 1].step_seconds:
            break
        key = (cfg, tuple(zeros))
        if key in done:
            found = [copy.deepcopy(e, {id(e.shape): e.shape, id(e.config): e.config}) for e in done[key]]
        else:
            found = done[key] = _variants(shape, cfg, batch, hw, zeros, recomputes, optimizer, usable, gpt, offloads,
                                          facts)
        for e in found:
            bisect.insort_right(out, e, key=_seconds)
        del out[limit:]
    return out


def _restricted_away(shape: ModelShape, gpus: int, restrict: dict) -> str | None:
    """What in ``restrict`` no layout can take: a tp that divides neither the heads and width nor the GPUs, a pp
    that does not divide the layers or the GPUs (the sizes that would); None where each value could be taken.

    >>> import types
    >>> gpt = types.SimpleNamespace(heads=32, hidden=4096, layers=32)
    >>> _restricted_away(gpt, 64, {"tp": 3})
    'tp=3 does not divide each of the 32 heads, the width 4096 and the 64 GPUs: tp one of 1, 2, 4, 8, 16, 32'
    """
    for key, sizes in ((Axis.TP, (shape.heads, shape.hidden, gpus)), (Axis.PP, (shape.layers, gpus))):
        if key not in restrict:
            continue
        wanted = restrict[key] if isinstance(restrict[key], (tuple, list, set, frozenset)) else (restrict[key],)
        ok = [v for v in range(1, gpus + 1) if all(n % v == 0 for n in sizes)]
        if not any(v in ok for v in wanted):
            what = (f"the {shape.heads} heads, the width {shape.hidden} and the {gpus} GPUs" if key == Axis.TP else
                    f"the {shape.layers} layers and the {gpus} GPUs")
            shown = ", ".join(map(str, wanted))
            return f"{key}={shown} does not divide each of {what}: {key} one of {', '.join(map(str, ok))}"
    return None


def plan_at_scale(model, gpus: int, batch: int, hw: Hardware, *, precision: str, optimizer: str = "adamw",
                  seq: int | None = None, memory_per_rank: int | None = None, limit: int | None = None,
                  policy=None, restrict: dict | None = None) -> Candidates:
    """``ck.plan`` on a hardware preset: ``search``'s estimates as ``Candidates``, fastest first."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"world_size must be a positive whole number of GPUs, got {gpus!r}: try 64")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be a positive whole number of sequences per step, got {batch!r}")
    shape, facts = shape_and_facts(model, policy, seq)  # read once: priced by the shape, judged by the facts
    found = search(shape, gpus, batch, hw, precision=precision, optimizer=optimizer, memory_per_rank=memory_per_rank,
                   restrict=restrict, limit=limit or 10, facts=facts)
    if not found and restrict:
        why = _restricted_away(shape, gpus, restrict)
        if why:
            raise ConfigError(f"restrict={restrict!r} leaves no layout of {gpus} GPUs for {shape.name}: {why}")
    if not found:
        need = shape.params * 16 / (memory_per_rank or hw.usable_bytes)
        raise ConfigError(f"no configuration of {gpus} GPUs of {hw.name} fits {shape.name} "
                          f"({shape.params / 1e9:.1f}B parameters) with a global batch of {batch} x {shape.seq} "
                          f"tokens{' under ' + repr(restrict) if restrict else ''}: its mixed-precision model states "
                          f"alone need about {need:.0f} GPUs' memory; use more GPUs, a batch that divides over them, "
                          f"or a preset with more memory per GPU")
    usable = memory_per_rank if memory_per_rank is not None else hw.usable_bytes
    out = Candidates(Candidate(e.config, e.memory, e.step_seconds, True, e.breakdown, e.collectives, estimate=e)
                     for e in found)
    out.constants, out.memory_per_rank = {"hardware": hw.name, "source": hw.source}, usable
    return out

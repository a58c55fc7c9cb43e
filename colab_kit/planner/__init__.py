"""``ck.plan``: which parallel configuration to run, estimated before anything runs.

    >>> import colab_kit as ck
    >>> from colab_kit.models import GPTConfig
    >>> model = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)
    >>> cands = ck.plan(model, 4, batch=16, constants=ck.planner.EXAMPLE_CONSTANTS)
    >>> cands[0].config.world_size, cands[0].fits
    (4, True)
    >>> sorted(cands[0].memory)[:4]
    ['activations', 'device', 'grads', 'host']

Every config that ``ParallelConfig`` accepts for ``world_size`` ranks, that every part of ``boost`` takes for
the model (``engine.rules.first_refusal`` over the model's facts, the question ``boost`` asks: what the engine runs,
sizes a tensor mode splits, the heads Ulysses splits, the sequence's split, blocks over the stages) and whose batch
splits (over dp x microbatches and the tensor plan's batch shards) is a candidate: dp, tp in four modes, pp with
every schedule and a few microbatch counts, ring / Ulysses / split_gather, ZeRO 0-3, offload none / cpu (and 'auto'
when ``memory_per_rank`` is given: ``cand.boost_kwargs == {"device_budget": memory_per_rank}``),
recomputation on and off. For each: memory per rank from ``colab_kit.memory.estimator.config_estimate``
(the estimate ``engine.memory_estimate()`` reports) and seconds per step from ``local.step`` with
constants measured on this machine (``constants``). Within one parallel shape (the degrees,
modes and schedule) a candidate that another one beats on both memory and time is dropped.

This package is ``colab_kit.planner``, not ``colab_kit.plan``: a submodule named ``plan``
would become the attribute ``colab_kit.plan`` once imported, shadowing the function
``ck.plan`` that ``colab_kit/__init__.py`` exports lazily from here.
"""
from __future__ import annotations

import torch.nn as nn

from ..config import ConfigError, ParallelConfig
from ..engine.facts import ModelFacts
from ..memory.estimator import (config_estimate, gpt_like, model_activations, part_params, traced_activations,
                                traced_mode)
from ..memory.formulas import auto_placed, optimizer_states, placed
from ..models import GPTConfig
from ..models.moe import has_experts
from ..policy import missing_policy_message, policy_for
from ..sharded_init import meta_twin
from .candidates import Candidate, Candidates
from .cluster.hardware import HARDWARE, Hardware
from .configs import enumerate_configs
from .dry_runs.exact import exact_states
from .estimate import hardware_of
from .local.constants import LOCAL, constants
from .local.step import step_seconds
from .moe.local import moe_configs, moe_step_seconds
from .search import plan_at_scale
from .shape import is_moe

__all__ = ["plan", "Candidate", "Candidates", "constants", "enumerate_configs", "EXAMPLE_CONSTANTS"]
# ck.estimate and the at-scale search: colab_kit.planner.estimate, .search, .shape; the cost models in rooms:
# .local (this machine), .cluster (a GPU cluster: .cluster.price, .cluster.hardware), .moe; ck.dry_run: .dry_runs

_OP = {"alpha": 1e-4, "beta": 1e9}
EXAMPLE_CONSTANTS = {"ranks": 0, "cores": 1024, "matmul": {"flops_per_s": 1e10}, "dispatch": {"op_seconds": 2e-5},
                     "memory": {"bytes_per_s": 1e10},
                     "comm": {"2": {op: dict(_OP) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                                             "all_to_all", "send", "sendrecv")}}}
"""Round numbers (not measured) for examples and tests that must not depend on the machine."""


def plan(model_cfg, world_size: int, batch: int, memory_per_rank=None, precision: str = "fp32",
         optimizer: str = "adamw", *, seq: int | None = None, constants: dict | None = None,
         limit: int | None = None, policy=None, input_shape: tuple | None = None, hardware=None,
         exact: int = 0, restrict: dict | None = None) -> Candidates:
    """Candidates for training ``model_cfg`` (a ``ck.models.GPTConfig``, or any model with a policy:
    BERT, ViT, a Hugging Face or a user's ``nn.Module``, see ``_other_model``) on ``world_size`` ranks with
    a global ``batch`` of rows per step, best first: those that fit ``memory_per_rank`` bytes
    (device bytes per rank), then by estimated seconds per step. ``limit`` keeps the first N.

    At scale, from a laptop: ``hardware`` names a cluster preset (``planner.cluster.hardware.HARDWARE``) or is a
    ``Hardware``; the candidates are then searched and priced by ``ck.estimate``'s at-scale model
    (``planner.search``: what cannot fit or is dominated is pruned before pricing; only candidates that fit the
    preset's usable memory, or ``memory_per_rank``, are listed; each carries its ``Estimate``). ``restrict``
    fixes ParallelConfig fields to a value or a tuple of values (``{"recompute": "full", "tp": (4, 8)}``).
    ``exact=k`` dry-runs the first k candidates that fit (``ck.dry_run``: each pipeline stage's first
    rank built under torch's fake process group) and replaces their model states by the exact bytes of
    their fullest rank, then ranks again (a candidate that no longer fits drops behind)::

        ck.plan(GPTConfig(...175B...), 1536, batch=1536, precision="fp16", hardware="8xA100-80GB", limit=10)

    Without ``constants`` or ``hardware`` the constants are measured here with ``world_size`` local
    processes, which is refused above 16 ranks (before anything starts).
    """
    if isinstance(exact, bool) or not isinstance(exact, int) or exact < 0:
        raise ConfigError(f"exact must be a whole number of candidates to dry-run, got {exact!r}: try 3")
    _check_arguments(memory_per_rank, precision, optimizer, seq, limit, restrict)
    if isinstance(model_cfg, nn.Module) and has_experts(model_cfg) and isinstance(getattr(model_cfg, "cfg", None),
                                                                                   GPTConfig):
        model_cfg = model_cfg.cfg  # the built-in MoE GPT: planned from its config (planner.moe.local)
    if hardware is not None:
        if constants is not None:
            raise ConfigError("give hardware= or constants=, not both: hardware names a preset's constants")
        hw = hardware_of(hardware)
        if hw != LOCAL:
            assert isinstance(hw, Hardware)
            optimizer_states(optimizer)
            cands = plan_at_scale(model_cfg, world_size, batch, hw, precision=precision, optimizer=optimizer,
                                  seq=seq, memory_per_rank=memory_per_rank, limit=None if exact else limit,
                                  policy=policy, restrict=restrict)
            if exact:
                cands = _ranked(exact_states(cands, model_cfg, batch, seq, optimizer, policy, exact,
                                             cands.memory_per_rank), limit, cands.constants, cands.memory_per_rank)
            return cands
    if restrict:
        raise ConfigError("restrict= narrows the at-scale search: give it with hardware=<preset>")
    if is_moe(model_cfg) and not isinstance(model_cfg, GPTConfig):
        raise ConfigError("ck.plan on this machine prices the built-in MoE GPT (give its GPTConfig); a Hugging Face "
                          "mixture of experts is priced at scale: ck.plan(model, world_size, batch, "
                          "hardware='8xH100-SXM'), or ck.estimate(model, config, batch)")
    if constants is None and isinstance(world_size, int) and world_size > 16:
        raise ConfigError(f"ck.plan for {world_size} ranks without constants would measure them with {world_size} "
                          f"local processes: pass hardware= (one of the presets: {', '.join(HARDWARE)}) or "
                          f"constants= (colab_kit.planner.cluster.hardware.hardware_constants(name), or your own)")
    cands = _plan(model_cfg, world_size, batch, memory_per_rank, precision, optimizer, seq=seq, constants=constants,
                  limit=None if exact else limit, policy=policy, input_shape=input_shape)
    if exact:
        cands = _ranked(exact_states(cands, model_cfg, batch, seq, optimizer, policy, exact, memory_per_rank),
                        limit, cands.constants, memory_per_rank)
    return cands


def _check_arguments(memory_per_rank, precision, optimizer, seq, limit, restrict) -> None:
    """``ck.plan``'s arguments, each refused with the rule and a value that works before anything is priced.

    >>> try:
    ...     _check_arguments(80, "fp32", "adamw", None, None, None)
    ... except ConfigError as e:
    ...     print(str(e)[:60])
    memory_per_rank=80 is in bytes: 80 GiB is 80 * 2**30 (858993
    """
    import dataclasses
    import difflib

    if memory_per_rank is not None:
        if isinstance(memory_per_rank, bool) or not isinstance(memory_per_rank, (int, float)) or memory_per_rank <= 0:
            raise ConfigError(f"memory_per_rank must be a number of bytes > 0 (or None: all the device's), got "
                              f"{memory_per_rank!r}: e.g. 80 * 2**30 for 80 GiB")
        if memory_per_rank < 1024:  # no device holds a step in less than a KiB: a number of GB, surely
            raise ConfigError(f"memory_per_rank={memory_per_rank!r} is in bytes: {memory_per_rank:g} GiB is "
                              f"{memory_per_rank:g} * 2**30 ({int(memory_per_rank * 2 ** 30)}; on the command line "
                              f"--memory {memory_per_rank:g}GiB)")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"precision={precision!r} is not one the engine trains in: 'fp32', 'bf16' or 'fp16'")
    try:
        optimizer_states(optimizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ConfigError(f"seq must be a whole number of tokens >= 1 (or None: the model's own), got {seq!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be a whole number of candidates >= 1 (or None: all), got {limit!r}")
    fields = [f.name for f in dataclasses.fields(ParallelConfig)]
    for key in restrict or {}:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            raise ConfigError(f"restrict={{{key!r}: ...}}: {key!r} is no ParallelConfig field"
                              + (f" (did you mean {near[0]!r}?)" if near else f": one of {', '.join(fields)}"))


def _plan(model_cfg, world_size: int, batch: int, memory_per_rank=None, precision: str = "fp32",
          optimizer: str = "adamw", *, seq: int | None = None, constants: dict | None = None,
          limit: int | None = None, policy=None, input_shape: tuple | None = None) -> Candidates:
    if isinstance(model_cfg, nn.Module) or not hasattr(model_cfg, "vocab_size") or not hasattr(model_cfg, "d_ff"):
        if not isinstance(model_cfg, nn.Module):
            raise ConfigError(f"ck.plan takes a GPTConfig or a model (an nn.Module with a policy), got "
                              f"{type(model_cfg).__name__}: pass the model itself, e.g. ck.plan(ViT(cfg), 4, 16)")
        return _other_model(model_cfg, world_size, batch, memory_per_rank, precision, optimizer, seq=seq,
                            constants=constants, limit=limit, policy=policy, input_shape=input_shape)

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive whole number of ranks, got {world_size!r}: try 4")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be a positive whole number of rows per step, got {batch!r}: "
                          f"try {world_size * 4}")
    optimizer_states(optimizer)  # an unknown name is refused here
    if memory_per_rank is not None and (not isinstance(memory_per_rank, int) or memory_per_rank <= 0):
        raise ConfigError(f"memory_per_rank must be a positive number of bytes, got {memory_per_rank!r}")
    seq = model_cfg.seq_len if seq is None else seq
    if seq != model_cfg.seq_len:
        import dataclasses
        model_cfg = dataclasses.replace(model_cfg, seq_len=seq)
    moe = bool(getattr(model_cfg, "n_experts", 0))
    configs = moe_configs if moe else enumerate_configs
    timed = moe_step_seconds if moe else step_seconds
    facts = ModelFacts.of(model_cfg, seq=model_cfg.seq_len)  # read once: every config judged by the engine's rules
    listed = list(configs(model_cfg, world_size, batch, precision, with_auto=memory_per_rank is not None,
                          facts=facts))
    if not listed:  # before the machine's constants are measured (ranks spawned: seconds)
        raise ConfigError(f"no configuration of {world_size} ranks runs this model with a global batch of {batch} "
                          f"rows: data parallelism needs the batch to split over dp x microbatches (a multiple of "
                          f"dp), tensor and sequence parallelism need the model's heads, sizes and sequence length "
                          f"to divide over them, a pipeline needs n_layers to split over its stages: try a batch "
                          f"that is a multiple of {world_size} (e.g. {world_size * max(1, round(batch / world_size))})")
    consts = constants if constants is not None else globals()["constants"](ranks=world_size)
    out = Candidates()
    out.constants, out.memory_per_rank = consts, memory_per_rank
    for cfg in listed:
        mem = config_estimate(model_cfg, cfg, batch, optimizer, host_share=None)
        kwargs = {}
        if cfg.offload == "auto":  # the placement puts on the host what does not fit
            assert memory_per_rank is not None  # enumerate_configs offers "auto" only with a budget
            kwargs = {"device_budget": memory_per_rank}
            mem = auto_placed(mem, memory_per_rank)
        seconds, parts, counts = timed(model_cfg, cfg, batch, consts, mem, optimizer)
        fits = memory_per_rank is None or sum(mem["device"].values()) <= memory_per_rank
        out.append(Candidate(cfg, mem, seconds, fits, parts, counts, kwargs))
    return _ranked(out, limit, consts, memory_per_rank)


def _ranked(out: list, limit, consts, memory_per_rank) -> Candidates:
    """The candidates no other of their layout beats, those that fit first, then by estimated step time."""
    kept = _prune(out)
    kept.sort(key=lambda c: (not c.fits, c.step_seconds))
    result = Candidates(kept[:limit] if limit else kept)
    result.constants, result.memory_per_rank = consts, memory_per_rank
    return result


def _prune(cands: list) -> list:
    """Within each parallel shape keep the candidates no other one beats on device bytes and time."""
    groups: dict = {}
    for c in cands:
        k = c.config
        layout = (k.dp, k.tp, k.pp, k.sp, k.ep, k.tp_mode, k.tp_depth, k.sp_mode, k.schedule, k.chunks)
        groups.setdefault(layout, []).append(c)
    kept = []
    for group in groups.values():
        for i, c in enumerate(group):
            mine = (c.device_bytes, c.step_seconds)
            if not any(o.device_bytes <= mine[0] and o.step_seconds <= mine[1]
                       and ((o.device_bytes, o.step_seconds) != mine or j < i) for j, o in enumerate(group) if j != i):
                kept.append(c)
    return kept


def _other_model(model, world_size, batch, memory_per_rank, precision, optimizer, *, seq, constants, limit,
                 policy, input_shape) -> Candidates:
    """``plan`` for any model with a policy, on a meta copy of it (nothing is made, the model is not touched).

    Each candidate passes the rules ``boost`` applies (``engine.rules`` over the model's facts, read once off the
    meta copy: a ViT gets no sp, a Llama no split_gather). Its
    model states are a GPT's of the same widths (``estimate.gpt_like``) scaled to the model's parameter
    count, its activations the dense forward traced with fake tensors and scaled by the layout
    (``estimate.model_activations``), its time the GPT cost model's. ``input_shape``: one global batch's
    input shape (default ``(batch, seq)`` of token ids, or the images ``(batch, channels, size, size)`` of a
    config with ``image_size``)::

        ck.plan(ck.models.ViT(ck.models.ViTConfig(num_classes=8, ...)), 4, 16)[0].config
    """
    import dataclasses

    import torch

    policy = policy_for(model, policy)
    if policy is None:
        raise ConfigError(missing_policy_message(model, "ck.plan"))
    twin = meta_twin(model)
    if policy.prepare is not None:
        policy.prepare(twin)
    gpt = gpt_like(twin, policy)
    cfg_m = getattr(model, "cfg", None)
    if input_shape is None:
        if policy.sequence:
            input_shape, dtype = (batch, seq or gpt.seq_len), torch.int64
        elif cfg_m is not None and hasattr(cfg_m, "image_size"):
            input_shape, dtype = (batch, cfg_m.channels, cfg_m.image_size, cfg_m.image_size), torch.float32
        else:
            raise ConfigError(f"ck.plan needs the input's shape for {type(model).__name__} (its inputs have no token "
                              f"dimension): pass input_shape=(batch, ...)")
    else:
        dtype = torch.int64 if policy.sequence else torch.float32
    if policy.sequence and input_shape[1] > gpt.seq_len:
        gpt = dataclasses.replace(gpt, seq_len=input_shape[1])
    parts = part_params(gpt, ParallelConfig())
    scale = sum(p.numel() for p in twin.parameters()) / (parts["embed"] + gpt.n_layers * parts["block"] + parts["tail"])
    facts = ModelFacts.of(twin, policy, seq=gpt.seq_len if policy.sequence else None)
    listed = list(enumerate_configs(gpt, world_size, batch, precision, with_auto=False, facts=facts))
    if not listed:  # before the constants are measured and the forward traced: "auto" needs the measured step
        raise ConfigError(f"no configuration of {world_size} ranks runs {type(model).__name__} with a global batch of "
                          f"{batch} rows: try a batch that is a multiple of {world_size}")
    consts = constants if constants is not None else globals()["constants"](ranks=world_size)
    traced: dict[str, int] = {}  # the forward traced once per mode it is traced under (``traced_mode``)
    out = Candidates()
    for cfg in listed:
        mem = config_estimate(gpt, cfg, batch, optimizer)
        states = {k: round(mem[k] * scale) for k in ("params", "grads", "optimizer")}
        mode = traced_mode(twin, policy, cfg)
        if mode not in traced:
            traced[mode] = traced_activations(twin, input_shape, dtype, precision, policy, mode)
        acts = model_activations(twin, policy, cfg, input_shape, dtype, traced=traced[mode])
        mem = placed({**states, "activations": acts}, cfg.zero, cfg.offload, None)
        seconds, cost_parts, counts = step_seconds(gpt, cfg, batch, consts, mem, optimizer)
        fits = memory_per_rank is None or sum(mem["device"].values()) <= memory_per_rank
        out.append(Candidate(cfg, mem, seconds, fits, cost_parts, counts, {}))
    return _ranked(out, limit, consts, memory_per_rank)

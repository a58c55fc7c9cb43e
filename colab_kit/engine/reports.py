"""What an engine reports about itself: memory by category and place (measured, and the estimate beside
it), its parameters' placements, recorded collectives, the last step's timeline, its parameters whole.

Each report is a function of an ``EngineView``: the typed, public fields a report may read of an engine
(``colab_kit.engine.core.Engine`` is one). ``engine.memory()``, ``memory_estimate()``, ``comm()`` and
``timeline()`` call these; the other reports (``ck.throughput``, ``ck.roofline``, ``ck.profile``,
``ck.memory_timeline``, ``ck.placements``, ``ck.state_vector``) take the engine as their argument, so a new
report adds a function, not a method of ``Engine``.

On rank 1 of ``ParallelConfig(dp=2)`` after one step::

    memory(engine)          # {"params": 441344, "grads": 441344, "optimizer": 882836, "activations": 2328836,
                            #  "device": {...}, "host": {...}, "step_peak": None}
    comm(engine, True)      # [{"op": "all_reduce", "axis": "dp", "bytes": ..., "tag": "grad bucket 0"}, ...]
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..config import Axis, ParallelConfig
from ..measure import optimizer_bytes, tensor_bytes
from ..memory.estimator import config_estimate, model_activations, traced_activations, traced_mode
from ..memory.formulas import estimate, optimizer_states, placed
from ..models import GPTConfig
from ..mesh import ProcessMesh
from .parallelize import Parallelized
from .step import TrainingStep

__all__ = ["EngineView", "memory", "memory_estimate", "placements", "comm", "timeline", "state_vector"]

_STATE_NAMES = {0: "sgd-nomomentum", 1: "sgd-momentum", 2: "adamw"}  # fp32 states per parameter -> estimator name


class EngineView(Protocol):
    """What a report may read of an engine: typed public fields, nothing private."""

    config: ParallelConfig
    mesh: ProcessMesh
    parts: Parallelized
    """What ``parallelize`` left: module, policy, plans, gradient part, placements, the step's events."""
    step: TrainingStep
    """The training step: its records (``step.records``), activation meter, pipeline, optimizer views."""
    optimizer: torch.optim.Optimizer
    traced: dict
    """The estimate's dense trace of the activations, per global input shape (filled on first use)."""


def memory(engine: EngineView) -> dict:
    """Measured bytes on this rank: params, grads, optimizer, activations (see colab_kit.memory),
    and where they live: ``"device"`` and ``"host"``, each a dict of the same four categories
    whose sum is the total.

    Held now, between steps: with ZeRO the optimizer states of this rank's pieces (1/(dp sp) of
    them, plus padding) and, at stage 2, only the gradient pieces (see colab_kit.zero). The
    device is the rank's accelerator; on a machine without one it is an account of the same
    host memory (``offload`` moves what it names to the "host" side of that account)::

        {"params": 441344, "grads": 441344, "optimizer": 882836, "activations": 2328836,
         "device": {"params": 441344, ..., "activations": 2328836},
         "host": {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}, "step_peak": None}

    ``step_peak``: the most bytes held at once inside a step. On a GPU the allocator's peak over the
    last step (``torch.cuda.max_memory_allocated``, reset as each step begins: every step, free). On
    CPU no allocator counts: the peak of the last ``memory_timeline`` (``colab_kit.memory.timeline``),
    None before one ran.
    """
    dp = engine.parts.data_parallel
    totals = {"params": _param_bytes(engine), "grads": dp.nbytes,  # fp32 masters are optimizer state
              "optimizer": optimizer_bytes(engine.optimizer) + dp.master_bytes(),
              "activations": engine.step.meter.peak}
    host = dict.fromkeys(totals, 0)
    host.update(engine.parts.data_parallel.host_bytes(engine.optimizer))
    return {**totals, "device": {k: totals[k] - host[k] for k in totals}, "host": host,
            "step_peak": engine.step.records.peak}


def _param_bytes(engine: EngineView) -> int:
    held = engine.parts.data_parallel.param_bytes()  # ZeRO-3: this rank's shards (and what is gathered now)
    return held if held is not None else tensor_bytes(engine.parts.module.parameters())


def memory_estimate(engine: EngineView) -> dict:
    """The estimate of ``memory()`` from ``colab_kit.memory.estimator.config_estimate``, the one ``ck.plan``
    ranks candidates by: the ZeRO paper's formulas for the model states of this rank's
    parameters (counted per tensor mode and pipeline stage), and the GPT activation count in this
    config's layout for the last step's batch (0 before a step). Another model: the model states
    of its measured parameter count and, with a policy, the activations of its dense forward traced on the
    meta device, scaled by this layout's share (``estimate.model_activations``; a Hugging Face mixture of experts'
    share from its own walk, as ``ck.estimate`` prices it). Same keys as
    ``memory()``, "device" and "host" included."""
    try:
        name = _STATE_NAMES[optimizer_states(engine.optimizer)]
    except ValueError:
        name = "adamw"
    cfg = engine.config
    share = engine.parts.data_parallel.host_share()
    rows, seq = engine.step.records.rows or 0, engine.step.records.seq
    micro = engine.step.pipeline.microbatch_shape() if engine.step.pipeline is not None else None
    if micro:  # with pp: the executor's microbatches of the last step
        rows, seq = micro
    model = engine.parts.model_cfg  # the dense model's config, also with pp
    if isinstance(model, GPTConfig):  # a GPT: the planner's estimate
        shards = engine.parts.tp_plan.batch_shards if engine.parts.tp_plan is not None else 1
        seq = seq or model.seq_len
        seq = seq * cfg.sp if engine.parts.sp_plan is not None else seq  # the engine keeps this rank's tokens
        est = config_estimate(model, cfg, rows * shards * cfg.dp * cfg.microbatches, name, seq=seq,
                              pp_rank=engine.mesh.rank(Axis.PP), host_share=share)
        if not rows:
            est = placed({**{k: est[k] for k in ("params", "grads", "optimizer")}, "activations": 0},
                         cfg.zero, cfg.offload, share)
        return est
    est = estimate(engine.parts.n_local, name, dp=cfg.zero_ranks, zero=cfg.zero, precision=cfg.precision,
                   offload=cfg.offload)  # ZeRO over dp x sp
    est["activations"] = 0
    shape = engine.step.records.input  # (the last step's global input shape, its dtype)
    policy = engine.parts.policy
    if policy is not None and shape is not None:
        mode = traced_mode(engine.parts.dense_twin, policy, cfg)
        cache, key = engine.traced, (shape, mode)  # the trace, once per input shape
        if key not in cache:
            cache.clear()
            cache[key] = traced_activations(engine.parts.dense_twin, *shape, cfg.precision, policy, mode)
        est["activations"] = model_activations(engine.parts.dense_twin, policy, cfg, *shape,
                                               pp_rank=engine.mesh.rank(Axis.PP), traced=cache[key])
    return placed(est, cfg.zero, cfg.offload, share)


def placements(engine: EngineView) -> list[dict]:
    """This rank's parameters and how each lies on the mesh, in DTensor's terms (``colab_kit.placement``)::

        {"name": "blocks.0.mlp.fc1.weight", "shape": (16, 32),
         "placements": "tp: Shard(0), dp: Replicate()"}            # tp=2, dp=2, tp_mode '1d'
        {"name": "blocks.1.mlp.experts.w_in", "shape": (2, 32, 32),
         "placements": "ep: Shard(0), edp: Replicate()"}           # dp=4, ep=2: experts over ep x edp
    """
    axes = [a for a in engine.mesh.layout.fine_names if engine.mesh.size(a) > 1 and a != Axis.PP]
    table = engine.parts.placement_table
    rows = table.rows(axes)
    if Axis.EP in engine.mesh.layout.axes:  # experts lie on ep and edp, which fold dp x sp
        folded = [a for a in axes if a not in (Axis.DP, Axis.SP)] + [Axis.EP]
        folded += [Axis.EDP] * (engine.mesh.size(Axis.EDP) > 1)
        on_ep = [any(Axis.EP in ax for _, ax in table[p].shards) for p in table.params]
        rows = [b if e else a for a, b, e in zip(rows, table.rows(folded), on_ep)]
    return [{"name": n, "shape": s, "placements": d} for n, s, d in rows]


def comm(engine: EngineView, last_step: bool = False) -> list[dict]:
    """This rank's recorded collectives (all, or those of the last step)."""
    log = engine.mesh.log
    return log.as_dicts(log.last_step() if last_step else None)


def timeline(engine: EngineView) -> list[dict]:
    """This rank's events of the last step: name, kind (compute/comm), start and end in seconds."""
    return sorted(engine.parts.events, key=lambda e: e["start"])


def state_vector(engine: EngineView) -> torch.Tensor:
    """All parameters flattened into one CPU vector (for checking ranks agree)."""
    with engine.parts.data_parallel.gathered():
        return torch.cat([p.detach().reshape(-1).cpu() for p in engine.parts.module.parameters()])

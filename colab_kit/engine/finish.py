"""The end of a training step, as a list one reads: every reduction of the gradients, the optimizer, each part's
work after it, the loss and the records (``end_step``; Megatron-Core's ``finalize_model_grads`` is the model).

The parts' work here is their hooks (``engine.parts``: "loss", "finish_grads", "after_optimizer",
"after_step"), run in the parts' order; each decides from the step whether it has work. ``describe(config)``
prints the list for a config::

    >>> from colab_kit import ParallelConfig
    >>> print(describe(ParallelConfig(dp=2, tp=2, zero=3), moe=True))
    microbatch: dropout (idle), expert
    loss: expert
    gradient sync: data_parallel (dp buckets or ZeRO's reduce-scatter)
    finish_grads: pipeline_split (idle), placements
    optimizer: clipping, fp16 scaling where asked, the step, gradients zeroed
    after_optimizer: expert, data_parallel
    scheduler, loss all-reduce
    after_step: data_parallel (idle)
    records
"""
from __future__ import annotations

import time

import torch

from ..precision import MasterWeights, master_step
from ..expert.records import loss_vector, step_layers, with_losses
from .parts import hooks

__all__ = ["describe", "end_step"]


def end_step(step, local: torch.Tensor) -> float:
    """After the last backward, as a list (``describe`` prints it for a config; every reduction of the
    gradients is in the first three lines, as Megatron-Core's ``finalize_model_grads``)::

        the parts' "loss" hooks           expert: this rank's share of the auxiliary losses
        data_parallel.finish()            the gradient sync: dp buckets waited, or ZeRO's reduce-scatter
        the parts' "finish_grads" hooks   pipeline: tied weights summed over pp; placements: what tp and
                                          sp keep whole summed over those axes
        the optimizer                     clipping, fp16 unscale and check, the step, gradients zeroed
        the parts' "after_optimizer"      expert: DeepSeek's router bias; data parallel: ZeRO's all-gather
        the scheduler, the loss           the global mean (with MoE layers their losses ride along)
        the parts' "after_step" hooks     data parallel: offload='auto' places its chunks after step one
        the records
    """
    for _, hook in hooks("loss"):
        local = hook(step, local)
    step.data_parallel.finish()
    masters = step.data_parallel.masters if isinstance(step.data_parallel.masters, MasterWeights) else None
    for _, hook in hooks("finish_grads"):
        hook(step, masters)
    done = _optimizer_step(step, masters)
    for _, hook in hooks("after_optimizer"):
        hook(step, done)
    lr = step.optimizer.param_groups[0]["lr"] if step.optimizer.param_groups else None  # what this step took
    if step.lr_scheduler is not None:  # once per step, after the optimizer (a skipped fp16 step too)
        step.lr_scheduler.step()
    value = _loss(step, local, done)
    for _, hook in hooks("after_step"):
        hook(step, done)
    if step.views:  # no view keeps a dropped gradient (or a moved chunk's old copy) alive
        step.views.release()
    step.records.add({"loss": value, **done, "seconds": time.perf_counter() - step.t0,
                      "input_shape": step.records.input[0] if step.records.input else None,
                      "lr": float(lr) if lr is not None else None})
    return value


def _optimizer_step(step, masters: MasterWeights | None) -> dict:
    """Clip, step (fp16: unscale and check, step the fp32 masters, copy them into the 16-bit parameters),
    zero the gradients; what happened (``skipped``, ``loss_scale``, ``note``, ``grad_norm``)."""
    done: dict = {"skipped": False, "loss_scale": None, "note": ""}
    if step.views:  # pieces that span param groups: their views see this step's storage and gradients
        step.views.bind()
    max_norm = step.max_grad_norm
    clip = (lambda: step.clip_now(max_norm)) if max_norm is not None else None
    with step.timed("optimizer step", "compute"):
        if masters is None:
            if clip is not None:
                done["grad_norm"] = clip()
            step.optimizer.step()
        else:
            done = master_step(step.optimizer, masters, step.scaler, step.mesh, before_step=clip)
        step.data_parallel.zero()
    if done["note"]:  # on the timeline, not the console
        now = time.perf_counter() - step.t0
        step.parts.events.append({"name": done["note"], "kind": "compute", "start": now, "end": now})
    return done


def _loss(step, local: torch.Tensor, done: dict) -> float:
    """The step's global mean loss (with MoE layers, their losses ride along: ``expert.records``, into
    ``done["moe"]``)."""
    layers = step_layers(step.moe_steps) if step.n_moe else {}
    with step.timed("loss all_reduce", "comm"):
        vec = loss_vector(local.detach(), step.moe_steps, step.n_moe) if step.n_moe else local
        reduced = step.mean(vec, pp=step.pipeline is not None)
    if step.n_moe:
        done["moe"] = with_losses(layers, reduced, step.n_moe)
    return reduced[0]


def describe(config=None, *, moe: bool = False, dropout: bool = False) -> str:
    """A training step's hooks as a list: the contexts each microbatch runs in, then the end of the step, each
    stage with the parts that work there (``engine.parts``' hooks); ``config``, ``moe`` (the model has MoE
    layers) and ``dropout`` (it has dropout) mark which of them have work for that run.

    >>> from colab_kit import ParallelConfig
    >>> print(describe(ParallelConfig(dp=2, pp=2, zero=1)))
    microbatch: dropout (idle), expert (idle)
    loss: expert (idle)
    gradient sync: data_parallel (dp buckets or ZeRO's reduce-scatter)
    finish_grads: pipeline_split, placements (idle)
    optimizer: clipping, fp16 scaling where asked, the step, gradients zeroed
    after_optimizer: expert (idle), data_parallel
    scheduler, loss all-reduce
    after_step: data_parallel (idle)
    records
    """
    busy = {"expert": {"microbatch": moe, "loss": moe, "after_optimizer": moe},
            "dropout": {"microbatch": dropout},
            "pipeline_split": {"finish_grads": config is None or config.pp > 1},
            "placements": {"finish_grads": config is None or config.tp > 1 or config.sp > 1},
            "data_parallel": {"after_optimizer": config is None or config.zero > 0,
                              "after_step": config is None or config.offload == "auto"}}

    def line(stage: str) -> str:
        names = [n + ("" if busy.get(n, {}).get(stage, True) else " (idle)") for n, _ in hooks(stage)]
        return f"{stage}: {', '.join(names)}"
    return "\n".join([line("microbatch"), line("loss"),
                      "gradient sync: data_parallel (dp buckets or ZeRO's reduce-scatter)", line("finish_grads"),
                      "optimizer: clipping, fp16 scaling where asked, the step, gradients zeroed",
                      line("after_optimizer"), "scheduler, loss all-reduce", line("after_step"), "records"])

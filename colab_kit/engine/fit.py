"""``engine.fit(loader, steps, checkpoint=PATH, every=N)``: a run that survives a dead rank.

``fit`` trains until the engine's step count reaches ``steps``, saving a checkpoint every ``every`` steps
(and at the end). Started again after a rank died (in a notebook after ``%colossal restart``, under
torchrun's ``--max-restarts``, or by hand), with the same call, it first loads the last complete
checkpoint at ``PATH`` (a save is atomic: a rank that died mid-save leaves the previous one whole) and goes
on from there: parameters, optimizer states, the LR scheduler, the loader's position and the losses so far
come back, so the run ends with the losses an uninterrupted one has; on the same or another number of
ranks (a checkpoint loads into any config, and the loader counts global batches).

Worked example, ``steps=8, every=3``, rank 1 killed during step 5::

    first start    steps 1 2 3 [save 3] 4 5 x   (the checkpoint at PATH holds step 3)
    second start   load step 3 -> steps 4 5 6 [save 6] 7 8 [save 8]
    engine.history  the 8 losses of an uninterrupted run
"""
from __future__ import annotations

import os

from ..checkpoint.files import MANIFEST

__all__ = ["fit", "complete"]


def complete(path) -> bool:
    """Whether ``path`` holds a complete checkpoint (its manifest is written last, by the atomic rename)."""
    return path is not None and os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def _agreed(engine, value: bool) -> bool:
    """``value`` on every rank, or an error naming the ranks that see otherwise (a path not shared)."""
    import torch.distributed as dist
    seen: list[bool] = [False] * dist.get_world_size()  # filled by the gather
    dist.all_gather_object(seen, bool(value))
    if len(set(seen)) > 1:
        raise RuntimeError(f"ranks {[r for r, v in enumerate(seen) if v != seen[0]]} see the checkpoint directory "
                           f"differently from rank 0: fit(checkpoint=) needs a directory every rank shares")
    return seen[0]


def fit(engine, loader, steps: int, *, checkpoint=None, every: int | None = None, on_step=None) -> list[float]:
    """Train ``engine`` on ``loader`` (a ``ShardedLoader``, e.g. ``engine.loader(...)``, whose position the
    checkpoint keeps) until ``engine.step_count == steps``; with ``checkpoint``, resume from it first where
    it is complete, and save to it every ``every`` steps and at the end. ``on_step(engine, loss)`` runs
    after each step. Returns the losses of the steps this call ran."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps is the step count to reach (a whole number >= 0), got {steps!r}")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every <= 0):
        raise ValueError(f"every must be a positive number of steps, got {every!r}")
    if every is not None and checkpoint is None:
        raise ValueError("every= saves checkpoints: give fit(..., checkpoint=PATH) too")
    if not callable(getattr(loader, "state_dict", None)) or not callable(getattr(loader, "next_batch", None)):
        raise TypeError(f"fit needs a loader whose position a checkpoint can keep (engine.loader(dataset, "
                        f"batch_size), a colab_kit.datasets.ShardedLoader), got {type(loader).__name__}")
    engine.current_loader = loader  # its position goes into every checkpoint
    if checkpoint is not None and _agreed(engine, complete(checkpoint)):
        engine.load(checkpoint)
    losses = []
    while engine.step_count < steps:
        loss = engine.train_step(loader.next_batch())
        losses.append(loss)
        if on_step is not None:
            on_step(engine, loss)
        if every is not None and engine.step_count % every == 0 and engine.step_count < steps:
            engine.save(checkpoint)
    if checkpoint is not None and losses:
        engine.save(checkpoint)
    return losses

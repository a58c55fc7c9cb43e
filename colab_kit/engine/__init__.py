"""The engine: ``boost`` composes the parallel parts into one ``Engine`` on every rank.

    core.py          boost() and Engine: train_step, eval, the hooks the parts call (pipeline.host's protocol)
    records.py       what an engine reports: memory by category and place, comm, timeline
    precision.py     fp32 master weights, fp32 reductions, fp16 loss scaling
    recompute.py     activation recomputation per transformer block
    sharded_init.py  each rank builds only its shards of a model made on the meta device
    optimizer.py     the user's optimizer and LR scheduler rebuilt over this rank's shards
    clipping.py      global gradient-norm clipping over every shard
    loss.py          the contract's loss, exact however the batch is split
    classes.py       forward-only subclasses made at run time
    fit.py           engine.fit: a run that checkpoints and survives a dead rank
    generate.py      engine.generate for causal LMs
    reference.py     the yardstick: plain PyTorch training in one process

The parallel parts (tensor, pipeline, sequence, zero) use this package's building blocks as plain modules
(``sharded_init.dense_value``, ``precision.MasterWeights``, ``classes.derived_class``) but never ``core``:
the engine object reaches them, and they reach it only through small protocols
(``colab_kit.pipeline.host.PipelineHost``, ``colab_kit.zero.GradientPart``). ``boost`` and ``Engine`` load
on first use, so ``import colab_kit.sharded_init`` does not import the whole engine.
"""
from __future__ import annotations

import importlib

__all__ = ["boost", "Engine"]


def __getattr__(name):
    # boost, Engine, and every other name of 0.1's colab_kit/engine.py (lm_loss, unsupported, ...), from core
    if not name.startswith("__"):
        core = importlib.import_module(".core", __name__)
        if hasattr(core, name):
            return getattr(core, name)
    raise AttributeError(f"module 'colab_kit.engine' has no attribute {name!r}")

"""The engine: ``boost`` composes the parallel parts into one ``Engine`` on every rank.

    core.py          boost() and Engine: train_step, eval, the hooks the parts call (pipeline.host's protocol)
    records.py       what an engine reports: memory by category and place, comm, timeline
    checks.py        check_policy: what boost refuses in the kernel, asking tensor, sequence and pipeline
    clipping.py      global gradient-norm clipping over every shard
    loss.py          the contract's loss, exact however the batch is split
    fit.py           engine.fit: a run that checkpoints and survives a dead rank
    generate.py      engine.generate for causal LMs
    reference.py     the yardstick: plain PyTorch training in one process

The engine sits above every part and below the planner (``docs/layout.md``): the building blocks the parts
share live below them (``colab_kit.sharded_init``, ``colab_kit.measure``, ``colab_kit.policy.classes``), each
part in its own package (``colab_kit.precision``, ``colab_kit.recompute``, ``colab_kit.zero.optimizer``, ...),
and the parts reach the engine object only through small protocols (``colab_kit.pipeline.host.PipelineHost``,
``colab_kit.zero.GradientPart``), never by importing it. ``boost`` and ``Engine`` load on first use, so
``import colab_kit.engine.reference`` does not import the whole engine.
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

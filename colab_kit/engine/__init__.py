"""The engine: ``boost`` = ``parallelize`` (this rank's share of the model) + the optimizer + one training step.

    parts.py         PARTS: every parallel part in its one order (each a colab_kit.part.Part declared in its
                     folder's part.py: name, wants, RULES, apply, hooks) and the engine's own steps;
                     first_refusal (what boost and the planner ask), plan_steps, hooks
    parallelize.py   ck.parallelize: a loop over PARTS, its result Parallelized
    step.py          TrainingStep: the one training step every config runs (batch split, F/B work or the
                     pipeline executor's actions), then finish.py's end_step
    finish.py        the end of a step as a list: the gradient sync, the parts' hooks (engine.parts), the
                     optimizer, the loss, the records; describe(config) prints it
    core.py          boost() and Engine: train_step, evaluate, generate, fit, save, load, close and the records
    reports.py       EngineView and the reports over it: memory (measured and estimated), comm, timeline, ...
    checks.py        check_policy: what boost refuses in the kernel (the policy's prepare, then the rules)
    facts.py         ModelFacts: what the rules read of a model (a module, a GPTConfig or a planner shape)
    clipping.py      global gradient-norm clipping over every shard
    loss.py          the contract's loss, exact however the batch is split
    fit.py           engine.fit: a run that checkpoints and survives a dead rank
    generate.py      engine.generate for causal LMs
    reference.py     the yardstick: plain PyTorch training in one process

The data flow of one engine, from ``boost`` to the records::

    boost(model, optimizer, config)
      -> first_refusal(config), check_policy (refusals before any collective) -> ProcessMesh.shared(config)
      -> parallelize: defer_init, dropout, tensor, sequence, recompute, pipeline_split, materialize,
                      placements, broadcast, precision, data_parallel  -> Parallelized (engine.parts)
      -> the optimizer over what grads.optimizer_layout() says this rank steps
      -> TrainingStep (engine.step): per step, the batch split, F/B (or the executor's actions), grads.finish,
         clipping, optimizer.step, scheduler.step -> StepRecords (engine.records, history) and parts.events
      -> reports (engine.memory(), comm(), timeline(); ck.throughput(engine), ck.profile(engine, ...)) read them

The parallel parts never import the engine: the pipeline executor is handed a ``MicrobatchWork`` per step
(``colab_kit.pipeline.work``) and returns; the gradient part is reached through ``colab_kit.zero.GradientPart``.
``boost`` and ``Engine`` load on first use.

The building blocks the parts share live below them (``colab_kit.sharded_init``, ``colab_kit.measure``,
``colab_kit.policy.classes``), each part in its own package (``docs/layout.md``).
"""
from __future__ import annotations

import importlib

__all__ = ["boost", "Engine"]


def __getattr__(name):
    # boost, Engine and core's other names (lm_loss, unsupported, ...), loaded on first use
    if not name.startswith("__"):
        core = importlib.import_module(".core", __name__)
        if hasattr(core, name):
            return getattr(core, name)
    raise AttributeError(f"module 'colab_kit.engine' has no attribute {name!r}")

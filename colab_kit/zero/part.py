"""The data-parallel part (plain dp, ZeRO 1-3): gradient sync and what the optimizer steps
(``apply_data_parallel``); after the optimizer, ZeRO's updated pieces gathered back; after the first step,
``offload='auto'`` places its chunks; its rule."""
from __future__ import annotations

from ..part import Build, NotYet, Part, rule
from .apply import apply_data_parallel


@rule(model=False, not_yet=True)
def zero3_pipeline(c, f):
    if c.zero == 3 and c.pp > 1:
        return NotYet("ZeRO stage 3 with pipeline parallelism", "zero=2 with pp (stage 3 would gather each stage's "
                      "parameters for every microbatch's forward and backward), or zero=3 with pp=1")
    return None


RULES = (zero3_pipeline,)
"""This part's rules, in the order they are asked."""


def apply(b: Build) -> None:  # dp or ZeRO 1-3: gradient sync and what the optimizer steps
    b.data_parallel = apply_data_parallel(b.module, b.mesh, b.config, b.policy, b.table, b.events,
                                  bucket_bytes=b.options.bucket_bytes, device_budget=b.options.device_budget,
                                  group_of_name=b.group_of_name)


def gather_params(step, done) -> None:  # ZeRO: the updated pieces all-gathered back into the parameters
    if step.config.zero and not done["skipped"]:
        with step.timed("all_gather params", "comm"):
            step.data_parallel.gather_params()


def place_chunks(step, done) -> None:  # offload='auto': the first step measured, the chunks are placed now
    if step.data_parallel.placement is not None:
        step.data_parallel.placement.after_step(next_activations=step.activation_reserve())


PART = Part("data_parallel", rules=RULES, apply=apply,
            hooks={"after_optimizer": gather_params, "after_step": place_chunks})

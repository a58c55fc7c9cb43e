"""A script under torchrun (test_join, test_two_hosts) and made-up planner candidates (viz, widgets)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch


from colab_kit.config import ParallelConfig
from colab_kit.datasets import SyntheticTokens

from .references import GPT_CFG


# =========================================================================== configs looped inside one spawn per world size
def rank0_per_world(fn, cases_by_world: dict, *args) -> dict:
    """Rank 0's dict from ``fn(cases, *args)`` in one ``ck.launch`` per world size, merged: the parity tests'
    way of looping every config of a size inside one spawn."""
    import colab_kit as ck

    out = {}
    for world, cases in cases_by_world.items():
        out.update(ck.launch(fn, world, cases, *args)[0])
    return out


def case_id(case, name: int = 0) -> str:
    """A parametrize id for ``(..., model name, {config fields}, ...)``: ``gpt-tp2-tp_mode2d``."""
    return f"{case[name]}-{'-'.join(f'{k}{v}' for k, v in case[name + 1].items())}"


# =========================================================================== a script under torchrun (test_join, test_two_hosts)
TORCHRUN_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torchrun_train.py"
TORCHRUN_STEPS = 4


def torchrun_reference():
    """The losses tests/scripts/torchrun_train.py must print: GPT_CFG with SGD + momentum in one process."""
    from colab_kit.engine.reference import single_process_losses
    return single_process_losses(GPT_CFG, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                 SyntheticTokens(64, 16, seed=1), TORCHRUN_STEPS, 8)[0]


def torchrun(args, env=None, prefix=()):
    return [*prefix, sys.executable, "-m", "torch.distributed.run", *args, str(TORCHRUN_SCRIPT)]


# =========================================================================== made-up planner candidates (viz, widgets)
MIB = 2**20


def planner_candidate(cfg, device_mib, ms, fits, why="compute", host_mib=0):
    dev = {"params": device_mib * MIB, "grads": 0, "optimizer": 0, "activations": 0}
    host = {"params": 0, "grads": 0, "optimizer": host_mib * MIB, "activations": 0}
    return SimpleNamespace(config=cfg, memory={"params": device_mib * MIB, "grads": 0, "optimizer": host_mib * MIB,
                                               "activations": 0, "device": dev, "host": host},
                           step_seconds=ms / 1e3, fits=fits, why=why)


CANDS = [planner_candidate(ParallelConfig(dp=4), 3, 20, True, "compute 80%"),
         planner_candidate(ParallelConfig(dp=4, zero=3, offload="cpu"), 1, 40, True, "host copies", host_mib=6),
         planner_candidate(ParallelConfig(tp=4), 9, 30, False, "tp all-reduce"),
         planner_candidate(ParallelConfig(pp=4, microbatches=4), 10, 50, False, "bubble 43%")]

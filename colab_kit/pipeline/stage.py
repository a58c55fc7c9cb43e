"""Cut a GPT into pipeline stages: each stage a module holding only its own parameters.

The ``n_layers`` blocks are dealt evenly over ``S = pp * chunks`` stages, in order;
the embeddings go with the first stage, the final LayerNorm and the LM head (and so
the loss) with the last. Stage ``s`` is chunk ``s // pp`` of the pipeline rank
``Plan.rank_of(s)`` names (the schedule's placement). Worked example, ``n_layers=4``, ``pp=2``::

    chunks=1 (gpipe, 1f1b, zb-h1)   rank 0: stage 0 = tok, pos, blocks 0-1
                                    rank 1: stage 1 = blocks 2-3, ln_f, head
    chunks=2, 'loop' (interleaved)  rank 0: stage 0 = tok, pos, block 0 | stage 2 = block 2
                                    rank 1: stage 1 = block 1 | stage 3 = block 3, ln_f, head
    chunks=2, 'v' (zb-v)            rank 0: stage 0 = tok, pos, block 0 | stage 3 = block 3, ln_f, head
                                    rank 1: stage 1 = block 1 | stage 2 = block 2

Under the V, rank 0 holds both the embeddings and the head (so the loss), and rank 1 passes
block 1's output to block 2 in its own memory.

The split works on the model *after* the tensor plan has sharded it, so a stage's
modules are the tensor-parallel layers of this rank: the model's own ``embed``,
blocks, ``ln_f`` and ``head`` run unchanged, on local shards. Any model with that
shape (``embed(tokens)`` using its other child modules, a ``blocks`` list, ``ln_f``
and ``head``) can be staged; ``ck.models.GPT`` is the one the engine ships.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ConfigError

__all__ = ["Stage", "stage_layers", "split_model", "check_stages"]

_TAIL = ("blocks", "ln_f", "head")


def check_stages(n_layers: int, config) -> None:
    """ConfigError unless ``n_layers`` blocks split evenly over ``pp * chunks`` stages (pure)."""
    n = config.pp * config.chunks
    if n_layers % n:
        ok = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
        raise ConfigError(f"n_layers={n_layers} does not split evenly over pp*chunks = {config.pp}*{config.chunks} = "
                          f"{n} pipeline stages: use n_layers a multiple of {n} (e.g. {n * max(1, n_layers // n)}), "
                          f"or pp*chunks one of {', '.join(map(str, ok))}")


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Block indices of each stage: ``stage_layers(4, 2) == [range(0, 2), range(2, 4)]``."""
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


class Stage(nn.Module):
    """Stage ``index`` of ``n_stages``: ``forward(x)`` maps its input to its output.

    The first stage takes token ids ``[b, t]``; the last returns logits. ``source_names``
    gives, for each of this stage's parameters in order, its name in the whole model
    (``blocks.2.attn.qkv.weight``), so it can be compared with an unsplit model.
    """

    def __init__(self, model: nn.Module, index: int, n_stages: int, layers: range, names: dict[int, str]):
        super().__init__()
        self.index, self.n_stages = index, n_stages
        self.first, self.last = index == 0, index == n_stages - 1
        if self.first:
            for name, child in model.named_children():
                if name not in _TAIL:
                    self.add_module(name, child)
            if hasattr(model, "cfg"):
                self.cfg = model.cfg
            self._embed = type(model).embed  # the model's own code, run on this module's children
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.layers = layers
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head
        self.source_names = [names[id(p)] for p in self.parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self._embed(self, x)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x

    def extra_repr(self) -> str:
        what = (["embeddings"] if self.first else []) + [f"blocks {self.layers.start}-{self.layers.stop - 1}"] + (
            ["ln_f, head"] if self.last else [])
        return f"stage {self.index} of {self.n_stages}: " + ", ".join(what)


def split_model(model: nn.Module, config, pp_rank: int) -> list[Stage]:
    """The stages of pipeline rank ``pp_rank``, in chunk order: ``Plan.stages_of`` under the schedule's
    placement (``[pp_rank, pp_rank + pp]`` for interleaved, ``[pp_rank, 2*pp - 1 - pp_rank]`` for zb-v)."""
    missing = [a for a in ("embed",) + _TAIL if not hasattr(model, a)]
    if missing:
        raise ConfigError(f"pipeline parallelism splits models shaped like ck.models.GPT (embed(), blocks, ln_f, "
                          f"head); {type(model).__name__} has no {', '.join(missing)}: use pp=1 for this model")
    check_stages(len(model.blocks), config)
    from .schedules import SCHEDULE_PLACEMENT, Plan

    n = config.pp * config.chunks
    names = {id(p): name for name, p in model.named_parameters()}
    layers = stage_layers(len(model.blocks), n)
    where = Plan(config.pp, config.microbatches, config.chunks, config.schedule,
                 placement=SCHEDULE_PLACEMENT[config.schedule])
    return [Stage(model, s, n, layers[s], names) for s in where.stages_of(pp_rank)]

"""ZeRO-3's units: what is gathered together, in the order the forward pass uses it.

A unit is a part of the model whose parameters are gathered before it runs and freed after: the
embeddings (everything outside the blocks and the tail: token and position tables, an embedding
LayerNorm), each block, and the tail (the policy's ``tail``: final norm and head). A model without a
policy's blocks is one unit, gathered for the whole step.

A weight tied between the embeddings and the head (BERT's table and decoder, a Hugging Face model with
``tie_word_embeddings``) lives in the embeddings' chunk; the tail *needs* that chunk too, so it is gathered
for the tail's forward and backward and freed in between, as the embeddings' own use is.

Worked example, a GPT of 2 blocks whose head is tied to ``tok`` (one rank of dp=4)::

    unit     kind    its parameters              needs (chunks gathered to run it)
    0        embed   tok.weight, pos.weight      [0]
    1        block   blocks.0.*                  [1]
    2        block   blocks.1.*                  [2]
    3        tail    ln_f.weight, ln_f.bias      [3, 0]   (head.weight is tok.weight: chunk 0)

    forward   gather 0 | block 0's pre-hook: free 0 | ... | tail: gather 3 and 0 (kept into its backward)
    backward  tail's grads -> reduce 3 | block 1's output gradient: free 0 | ... | block 0's input
              gradient: gather 0 | tok's gradient (both uses summed by autograd) -> reduce 0, free 0
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

__all__ = ["Unit", "units_of", "tied_to_embed"]


@dataclass
class Unit:
    """One unit (see the module docstring): ``kind`` "embed", "block", "tail" or "all" (no blocks)."""

    name: str
    kind: str
    block: nn.Module | None
    params: list[nn.Parameter]


def _outside(module: nn.Module, stop: set[int]) -> set[int]:
    """Ids of the parameters registered on modules of ``module`` that are not under a module in ``stop``."""
    out: set[int] = set()

    def walk(m: nn.Module) -> None:
        if id(m) in stop:
            return
        out.update(id(p) for p in m._parameters.values() if p is not None)
        for c in m.children():
            walk(c)

    walk(module)
    return out


def units_of(module: nn.Module, blocks: nn.ModuleList | None = None, tail=()) -> list[Unit]:
    """The units of ``module`` in forward order (trainable parameters only): the embeddings, each of
    ``blocks`` (the policy's list), then the modules of ``tail``; without ``blocks``, one unit of everything."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        return [Unit("rest", "all", None, trainable)]
    inner = {id(p) for b in blocks for p in b.parameters()}
    tail = [m for m in tail if m is not None]
    outside = _outside(module, {id(blocks)} | {id(m) for m in tail})
    embed = [p for p in trainable if id(p) not in inner and id(p) in outside]
    claimed = inner | {id(p) for p in embed}
    tails = [p for p in trainable if id(p) not in claimed]
    units = [Unit("embed", "embed", None, embed)]
    units += [Unit(f"blocks.{i}", "block", b, [p for p in b.parameters() if p.requires_grad])
              for i, b in enumerate(blocks)]
    if tails or tail:
        units.append(Unit("tail", "tail", None, tails))
    return units


def tied_to_embed(units: list[Unit], tail) -> bool:
    """Whether a tail module uses a parameter of the embeddings' unit (a tied head)."""
    embed = {id(p) for p in units[0].params}
    return any(id(p) in embed for m in tail for p in m.parameters())

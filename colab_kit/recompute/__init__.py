"""Recomputation: each transformer block keeps only its input, and runs its forward again in backward.

``ParallelConfig(recompute=...)`` is "none", "selective", "op" or "full" (True / False read as "full" /
"none"); this module is "full". "selective" recomputes only attention's core (``colab_kit.recompute.selective``,
Korthikanti et al. 2022); "op" runs each block under per-op selective checkpointing, keeping the attention
kernel's and every second matmul's outputs (``colab_kit.recompute.op``, torchtitan's); what each mode keeps,
with the formula and a measurement: docs/training.md.

``ParallelConfig(recompute=True)`` (or "full") asks ``ck.boost`` for it (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost", arXiv 1604.06174; Colossal-AI calls it activation
checkpointing). After the tensor plan and before the pipeline split, the engine calls
``recompute_blocks(model)``: every module of ``model.blocks`` then runs its own forward under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. The model's code is not
touched: only the block's class changes, to a subclass whose ``forward`` wraps the original
(``Block`` becomes ``RecomputedBlock``; parameter names and state-dict keys stay the same,
the way ``zero_bubble.use_split_backward`` turns an ``nn.Linear`` into a ``DeferredLinear``).

What autograd keeps, one GPT block, a microbatch of N = b*t rows, hidden h, MLP f, heads a,
fp32 (``colab_kit.memory.activation_bytes`` counts it; ``ActivationMeter`` measures it)::

    without recompute   LayerNorm inputs and outputs, q k v, attention output and its
                        log-sum-exp, the MLP's inner activations: 4N(8h + 2f) + 4N(a + 4) B
    with recompute      the block's input [b, t, h]: 4Nh B
    in backward         block i's forward runs again (its saved tensors live until its
                        backward is done), then block i's backward: one block's worth extra

So the activations held between forward and backward fall from L blocks' worth to L inputs,
and a step runs every block's forward once more, all but ``fc2``'s matmul (torch's checkpoint
stops once the last saved tensor, ``fc2``'s input, is rebuilt): 1.21 times the matmul FLOPs of
a step without, for the demo GPT and the 4-block test GPT alike (FlopCounterMode). That is
for ``nn.Linear``; the ``ZeroBubbleLinear`` of the 1D and zero-bubble layers is an autograd
function, which saves after its matmul, so there ``fc2``'s matmul runs again as well.

Each rank sees its own blocks run twice; collectives inside a block run twice as well. With
tp=2 (1d), per block and microbatch: forward all-reduces after ``attn.proj`` and ``mlp.fc2``;
in backward the recomputation runs the attention's all-reduce again (it stops, as torch's
checkpoint does, once the last saved tensor, ``fc2``'s input, is rebuilt, so before
``fc2``'s all-reduce), then the backward's two all-reduces. The comm log of a step with
recompute has one more tp all-reduce per block and microbatch than without (tested in
``tests/ranks/test_recompute.py``). Every rank of a tp group recomputes the same ops in the same
order, so the extra collectives match up.

Pipeline stages hold the same block modules, so a stage recomputes its blocks in its B (or
I). Under the zero-bubble split (``tensor.zero_bubble``) the recomputed forward runs inside
the I pass: each ``ZeroBubbleLinear`` gets its input back from the recomputation and pushes
``(x, g)`` on the ``WeightGradStore`` as before, so W still computes every deferred dW. That
store is what W needs, recomputed or not, so on a rank that runs I and W apart the peak
falls less. Measured, 4-block GPT (d=32, t=16), a global batch of 8 rows, bytes per rank,
without -> with recompute::

    dp=2                      567,940 ->  68,228 B   (0.12)
    tp=2 (1d)                 720,256 -> 118,144 B   (0.16)
    pp=2 1f1b, 4 microbatches rank 0: 268,544 -> 18,688 B (0.07)  rank 1: 150,788 -> 25,860 B (0.17)
    pp=2 zb-h1                rank 0: 268,544 -> 18,688 B (0.07)  rank 1: 293,412 -> 286,720 B (0.98)

The meter (``colab_kit.memory.ActivationMeter``) counts what saved-tensor hooks see. The
checkpoint keeps the block's input in a closure, out of their sight, and its own hooks hide
the block's saved tensors (the innermost hooks win); ``_Hold`` saves the input through the
hooks active outside the block, so the meter counts it, once, as it is really held.

The recomputation runs under the dropout coordinates of the block's first forward
(``colab_kit.models.dropout.at``, through the checkpoint's ``context_fn``), so it draws the same masks
even where autograd runs backward on a thread of its own (a GPU's).

The recomputation calls the block's original forward directly: hooks registered on the block
itself fire once (around the forward), hooks on its submodules fire again in backward. A part
that gathers parameters in module hooks (ZeRO stage 3) must gather them for the recomputation
too. Checked by hand as well as in the tests: tp=4 '2d' and '2.5d', tp=8 '3d', dp=2 x tp=2,
pp=2 x tp=2 zb-h1, pp=2 x dp=2 interleaved and zb-v, dp=4 with zero=1 and zero=2 all train
to one process's losses with recompute on (largest relative difference 1.2e-7).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..models import dropout, moe_context

from ..policy.classes import derived_class, derived_from
from ..config import ConfigError
from ..policy import missing_policy_message, policy_for
from .hold import _Hold

__all__ = ["recompute_blocks", "is_recomputed", "recomputed_class"]



def recomputed_class(cls: type) -> type:
    """The subclass of ``cls`` whose forward recomputes in backward (one per class, made once)."""
    if derived_from(cls, "Recomputed") is not None:
        return cls

    def make_forward(cls):
        def forward(self, x, *args, **kwargs):
            if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
                return cls.forward(self, x, *args, **kwargs)
            coords = dropout.current()  # the recomputation draws the dropout masks of this forward
            moe = moe_context.current()  # ... and routes with its MoE counts (no collective in backward)
            return checkpoint(cls.forward, self, _Hold.apply(x), *args, use_reentrant=False,
                              context_fn=lambda: (nullcontext(), _as_first(coords, moe)), **kwargs)
        return forward

    return derived_class(cls, "Recomputed", make_forward, __name__,
                         f"``{cls.__name__}`` whose activations are recomputed in backward "
                         "(colab_kit.recompute).")


@contextmanager
def _as_first(coords, moe):
    """The contexts a block's first forward ran in: its dropout coordinates and its MoE step."""
    with dropout.at(coords), moe_context.at(moe):
        yield


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``module``'s forward recomputes its activations in backward."""
    return derived_from(type(module), "Recomputed") is not None


def recompute_blocks(model: nn.Module, policy=None) -> int:
    """Make every block of ``model`` (the policy's ``blocks``: ``model.blocks`` for the built-in
    models) recompute its activations in backward; returns how many changed (calling it twice
    changes nothing more).

    >>> from colab_kit.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layers=2))
    >>> recompute_blocks(model), type(model.blocks[0]).__name__, recompute_blocks(model)
    (2, 'RecomputedBlock', 0)
    """
    return swap_blocks(model, policy, recomputed_class, "Recomputed", "recompute=True (which checkpoints each block)")


def swap_blocks(model: nn.Module, policy, make_class, marker: str, what: str) -> int:
    """Give every block the policy names the class ``make_class`` derives from its own (``marker``: the derived
    classes' name, so a block already swapped is left); how many changed. ``what`` names the mode in the
    refusal of a model without a policy."""
    policy = policy_for(model, policy)
    if policy is None:
        raise ConfigError(missing_policy_message(model, what))
    changed = 0
    for block in policy.block_list(model):
        if derived_from(type(block), marker) is None:
            block.__class__ = make_class(type(block))
            changed += 1
    return changed

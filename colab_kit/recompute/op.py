"""Per-op selective activation checkpointing ("op" SAC, torchtitan's ``SelectiveAC``), ``recompute="op"``.

Each block the policy names (GPT, BERT, ViT; a Hugging Face model's decoder layers) runs under
``checkpoint(use_reentrant=False)`` with ``create_selective_checkpoint_contexts(policy)``; the policy (one per
forward of one block) keeps (``MUST_SAVE``):

- the attention kernel's output and log-sum-exp (``_scaled_dot_product_flash_attention_for_cpu``, what SDPA
  runs on CPU in torch 2.13, and the GPU kernels), where autograd records it: a kernel inside an autograd
  Function (the ring's steps, whose merged output the ring saves itself) runs again with the Function;
- every second matmul (``aten.mm`` / ``aten.addmm``): the 1st, 3rd, ... A GPT block keeps qkv's and fc1's
  outputs and recomputes proj (fc2's output is saved by nothing, and torch's checkpoint stops once the last
  tensor backward needs is rebuilt, so fc2 does not run again: one proj matmul a block, measured in
  tests/ranks/test_recompute.py); a Llama layer keeps q, v, gate and down;
- functional collectives' outputs (``_c10d_functional``). colab_kit's collectives are c10d's in-place ops: a
  replayed output would leave the buffer the caller reads unwritten, so they run again, as under "full";

and recomputes the rest (``PREFER_RECOMPUTE``). The matmul count is kept per pass (torchtitan's
``forward_mm_count`` / ``recompute_mm_count``): older torch asked the policy again in recomputation; 2.13 asks
in the forward only and replays by call index. A GPT block keeps (N tokens, e bytes, tp 1D ranks)::

    e N h (its input) + 3 e N h / tp (qkv) + (e N h + 4 N a) / tp (kernel: output, lse) + e N f / tp (fc1)

(``memory.activation_bytes(..., recompute="op")``). The cache lives in the SAC context, out of sight of saved-
tensor hooks; ``_Keep`` passes the same storages through the hooks outside the block (no byte more), so
``ActivationMeter`` counts them. The recomputation runs under the dropout coordinates and MoE step of the
block's first forward (``_as_first``). More, with measurements: docs/training.md.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..models import dropout, moe_context
from ..policy.classes import derived_class, derived_from
from . import _as_first, swap_blocks
from .hold import _Hold

__all__ = ["op_policy", "kept_through_hooks", "op_recomputed_class", "is_op_recomputed", "recompute_ops",
           "SAVED_OPS", "MATMULS", "ATTENTION"]


def _ops(root, *names) -> frozenset:
    """The ``default`` overloads of the ops named that this torch has (GPU kernels exist on CPU builds too)."""
    return frozenset(getattr(root, n).default for n in names if hasattr(root, n))


MATMULS = _ops(torch.ops.aten, "mm", "addmm", "linear")  # linear: backends that keep it whole
"""The matmuls counted: every second one is kept."""
ATTENTION = _ops(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable")
"""The attention kernels (``F.scaled_dot_product_attention``'s, on CPU and GPU)."""
SAVED_OPS = ATTENTION | _ops(torch.ops._c10d_functional, "all_reduce", "all_gather_into_tensor",
                             "reduce_scatter_tensor", "all_to_all_single")
"""The ops whose outputs are kept: attention kernels (called where autograd records), out-of-place collectives."""


def op_policy():
    """A fresh policy for one forward of one block (its own matmul count); ``policy.kept`` collects the
    tensors it keeps (for the meter).

    >>> p = op_policy()
    >>> ctx = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
    >>> [p(ctx, torch.ops.aten.addmm.default).name for _ in range(3)], p(ctx, torch.ops.aten.gelu.default).name
    (['MUST_SAVE', 'PREFER_RECOMPUTE', 'MUST_SAVE'], 'PREFER_RECOMPUTE')
    """
    counts = {"forward_mm_count": 0, "recompute_mm_count": 0}
    kept: list[torch.Tensor] = []

    def policy(ctx, func, *args, **kwargs):
        if func in MATMULS:
            key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
            counts[key] += 1
            save = counts[key] % 2 == 1
        else:  # a kernel inside an autograd Function (the ring's steps: it saves its merged output) runs again
            save = func in SAVED_OPS and (func not in ATTENTION or torch.is_grad_enabled())
        if save and not ctx.is_recompute:
            out = getattr(ctx, "op_output", None)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            kept.extend(t.detach() for t in outs if isinstance(t, torch.Tensor))  # before autograd records it
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    policy.kept = kept  # type: ignore[attr-defined]
    return policy


class _Keep(torch.autograd.Function):
    """Identity on ``y`` that saves ``kept`` (the SAC cache's tensors) through the saved-tensor hooks outside
    the block, so that ``ActivationMeter`` counts them; freed at ``y``'s gradient, when the block's
    recomputation takes them over."""

    @staticmethod
    def forward(ctx, y, *kept):
        ctx.save_for_backward(*kept)
        ctx.n = len(kept)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return (g,) + (None,) * ctx.n


@contextmanager
def _entered(mode, coords, moe):
    with mode, _as_first(coords, moe):
        yield


def _contexts(policy, coords, moe):
    caching, cached = create_selective_checkpoint_contexts(policy)
    return caching, _entered(cached, coords, moe)


def kept_through_hooks(out, kept):
    """``out`` with ``kept`` held by ``_Keep`` on its first tensor (a block returns a tensor or a tuple)."""
    if not kept:
        return out
    if isinstance(out, torch.Tensor):
        return _Keep.apply(out, *kept)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (_Keep.apply(out[0], *kept),) + out[1:]
    return out


def op_recomputed_class(cls: type) -> type:
    """The subclass of ``cls`` whose forward runs under per-op SAC (one per class, made once)."""
    if derived_from(cls, "OpRecomputed") is not None:
        return cls

    def make_forward(cls):
        def forward(self, x, *args, **kwargs):
            if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
                return cls.forward(self, x, *args, **kwargs)
            policy = op_policy()
            context_fn = functools.partial(_contexts, policy, dropout.current(), moe_context.current())
            out = checkpoint(cls.forward, self, _Hold.apply(x), *args, use_reentrant=False, context_fn=context_fn,
                             **kwargs)
            kept = policy.kept[:]
            policy.kept.clear()  # _Keep holds them now, until the block's recomputation takes them over
            return kept_through_hooks(out, kept)
        return forward

    return derived_class(cls, "OpRecomputed", make_forward, __name__,
                         f"``{cls.__name__}`` under per-op selective checkpointing (colab_kit.recompute.op).")


def is_op_recomputed(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs under per-op SAC."""
    return derived_from(type(module), "OpRecomputed") is not None


def recompute_ops(model: nn.Module, policy=None) -> int:
    """Run every block of ``model`` (the policy's ``blocks``) under per-op SAC; returns how many changed.

    >>> from colab_kit.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layers=2))
    >>> recompute_ops(model), type(model.blocks[0]).__name__, recompute_ops(model)
    (2, 'OpRecomputedBlock', 0)
    """
    return swap_blocks(model, policy, op_recomputed_class, "OpRecomputed",
                       "recompute='op' (which checkpoints each block op by op)")

"""Megatron's four autograd functions of a tensor-parallel group (``copy_to_group`` and
``reduce_from_group``: identity one way, all-reduce the other; ``gather_from_group`` and
``split_to_group``: all-gather one way, keep this rank's slice the other), on the recorded
collectives. Part of ``colab_kit.comm``."""
from __future__ import annotations

import torch

from .collectives import all_gather, all_reduce

__all__ = ["copy_to_group", "reduce_from_group", "gather_from_group", "split_to_group"]


class CopyToGroup(torch.autograd.Function):
    """Megatron's f: forward identity; backward all-reduce (sum) of the gradient over ``axis``.

    Put in front of a column-parallel layer whose input is replicated: each rank's
    slice of the layer contributes part of the input gradient.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.mesh, ctx.axis, tag="f backward"), None, None


class ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: forward all-reduce (sum) over ``axis``; backward identity.

    Put after a row-parallel layer: each rank holds a partial sum of the output.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis):
        return all_reduce(x.contiguous().clone(), mesh, axis, tag="g forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromGroup(torch.autograd.Function):
    """Forward all-gather along ``dim`` over ``axis``; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return all_gather(x, mesh, axis, dim, tag="gather forward")

    @staticmethod
    def backward(ctx, grad):
        n, i = ctx.mesh.size(ctx.axis), ctx.mesh.rank(ctx.axis)
        return grad.chunk(n, dim=ctx.dim)[i].contiguous(), None, None, None


class SplitToGroup(torch.autograd.Function):
    """Forward keeps this rank's slice of ``dim``; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        n, i = mesh.size(axis), mesh.rank(axis)
        return x.chunk(n, dim=dim)[i].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.mesh, ctx.axis, ctx.dim, tag="split backward"), None, None, None


def copy_to_group(x, mesh, axis):
    return CopyToGroup.apply(x, mesh, axis) if mesh.size(axis) > 1 else x


def reduce_from_group(x, mesh, axis):
    return ReduceFromGroup.apply(x, mesh, axis) if mesh.size(axis) > 1 else x


def gather_from_group(x, mesh, axis, dim=-1):
    return GatherFromGroup.apply(x, mesh, axis, dim % x.dim()) if mesh.size(axis) > 1 else x


def split_to_group(x, mesh, axis, dim=-1):
    return SplitToGroup.apply(x, mesh, axis, dim % x.dim()) if mesh.size(axis) > 1 else x

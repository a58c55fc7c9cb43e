"""DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509): all-to-all around attention.

Each rank of the ``sp`` axis holds all heads of its ``t / sp`` tokens. One all-to-all
turns that into all ``t`` tokens of ``heads / sp`` heads; attention is then the plain
causal one over the whole sequence of those heads (any kernel: SDPA here), and a second
all-to-all turns the output back to the rank's tokens. The backward of an all-to-all is
the reverse all-to-all (``UlyssesAllToAll``). q, k and v travel in one message.

Worked example, sp=2, 4 heads, t=8, contiguous layout (rank 0 tokens 0-3, rank 1 tokens 4-7)::

    before      rank 0: heads 0-3 x tokens 0-3       rank 1: heads 0-3 x tokens 4-7
    all-to-all  rank 0: heads 0-1 x tokens 0-7       rank 1: heads 2-3 x tokens 0-7
    attention   causal SDPA on [b, 2, 8, d] on each rank (no communication)
    all-to-all  rank 0: heads 0-3 x tokens 0-3       rank 1: heads 0-3 x tokens 4-7

Layout: Ulysses needs no causal balancing (every rank gets whole rows of whole heads),
so its natural layout is ``"contiguous"`` (the default). It also takes the ring's
``"zigzag"`` layout, so one data split serves both modes: the gathered sequence is then
in rank order of the zigzag chunks (``zigzag.gathered_order``), put into natural order
before the causal attention and back after (two index_selects, no communication).

The heads must divide by sp; a ``ConfigError`` (a ValueError) names the valid sp otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from ..config import Axis, ConfigError
from .zigzag import LAYOUTS, gathered_order
from .ring import gather_keys

__all__ = ["UlyssesAllToAll", "ulysses_attention", "check_heads"]


class UlyssesAllToAll(torch.autograd.Function):
    """``apply(x, mesh, axis, split_dim, cat_dim)``: ``comm.all_to_all`` forward; the reverse one backward.

    Sequence-to-heads on ``[3, b, heads, t/sp, d]`` is ``split_dim=2, cat_dim=3`` (-> ``[3, b,
    heads/sp, t, d]``); heads-to-sequence on ``[b, heads/sp, t, d]`` is ``split_dim=2, cat_dim=1``.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis, split_dim, cat_dim):
        ctx.mesh, ctx.axis, ctx.split_dim, ctx.cat_dim = mesh, axis, split_dim, cat_dim
        return comm.all_to_all(x, mesh, axis, split_dim, cat_dim, tag="ulysses")

    @staticmethod
    def backward(ctx, grad):
        back = comm.all_to_all(grad, ctx.mesh, ctx.axis, ctx.cat_dim, ctx.split_dim, tag="ulysses backward")
        return back, None, None, None, None


def check_heads(heads: int, sp: int) -> None:
    """Refuse a head count that sp does not divide, naming the sp that would."""
    if heads % sp:
        ok = [s for s in range(1, heads + 1) if heads % s == 0]
        raise ConfigError(f"sp_mode='ulysses' gives each of the sp ranks heads/sp whole heads, so sp must divide "
                          f"the {heads} heads (sp={sp} does not): use sp in {ok}, or sp_mode='ring'")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, axis: str = Axis.SP, *,
                      layout: str = "contiguous", causal: bool = True, mask: torch.Tensor | None = None,
                      keys: torch.Tensor | None = None, local=None, wrap=None) -> torch.Tensor:
    """Self-attention of the sequence split over ``axis``, by the Ulysses all-to-all: causal, or bidirectional
    with ``causal=False``; keys masked out where ``mask [b, t_local]`` (this rank's tokens) is False (every
    rank's mask is all-gathered, a few bytes per token, so each rank sees the whole sequence's).

    ``q, k, v``: ``[b, heads, t_local, d]``, this rank's ``t / sp`` tokens in ``layout``;
    returns this rank's rows of the causal attention, same shape and layout. Records two
    ``all_to_all@sp`` in the forward and two in the backward. ``local(q, k, v, keys)``: the attention of
    the whole sequence on this rank's heads, in natural token order (default SDPA; a Hugging Face model
    with attention dropout passes eager attention with ``colab_kit.models.dropout``'s masks). ``wrap``: what the
    local attention runs in (selective recomputation passes its checkpoint: only the core between the
    all-to-alls runs again in backward, the all-to-alls do not).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"ulysses_attention needs q, k of one shape [b, heads, t_local, d] and v of "
                         f"[b, heads, t_local, d_v], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n = mesh.size(axis)
    check_heads(q.shape[1], n)

    def core(q, k, v, keys):
        if local is not None:
            return local(q, k, v, keys)
        if keys is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        allowed = keys[:, None, None, :]
        if causal:
            allowed = allowed & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    attend = core if wrap is None else wrap(core)
    if n == 1:
        return attend(q, k, v, mask)
    if mask is not None:  # [sp, b, t_local] in rank order -> [b, t] in the gathered order
        if keys is None:  # ``keys``: ``gather_keys(mask)`` made once for every layer
            keys = gather_keys(mask, mesh, axis)
        keys = keys.transpose(0, 1).reshape(mask.shape[0], -1)
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank, got t_local={q.shape[2]}: "
                         f"the sequence must be a multiple of 2*sp = {2 * n}")
    if v.shape == q.shape:  # one all-to-all for the three
        qkv = UlyssesAllToAll.apply(torch.stack([q, k, v]), mesh, axis, 2, 3)   # [3, b, heads/sp, t, d]
        parts = [qkv[0], qkv[1], qkv[2]]
    else:  # a value head of its own width (DeepSeek's MLA: d_qk 192, d_v 128): q and k in one, v in another
        qk = UlyssesAllToAll.apply(torch.stack([q, k]), mesh, axis, 2, 3)
        parts = [qk[0], qk[1], UlyssesAllToAll.apply(v.unsqueeze(0), mesh, axis, 2, 3)[0]]
    order = None
    if layout == "zigzag":
        order = gathered_order(n, n * q.shape[2], layout, device=q.device)
        parts = [t.index_select(2, order.argsort()) for t in parts]             # natural token order
        keys = keys.index_select(1, order.argsort()) if keys is not None else None
    out = attend(parts[0], parts[1], parts[2], keys)
    if order is not None:
        out = out.index_select(2, order)                                     # back to rank order
    return UlyssesAllToAll.apply(out, mesh, axis, 2, 1)                      # [b, heads, t/sp, d]

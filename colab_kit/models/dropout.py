"""Dropout that does not depend on the layout: each mask element is a pure function of
``(seed, step, layer, the element's global coordinates)``.

``nn.Dropout`` draws from the device's RNG, so a tensor split over ranks (dp rows, microbatches,
tp heads or features, 2D/3D blocks, sp chunks) or computed twice (recomputation) draws masks that
one process never would. Megatron's RNG tracker only keeps replicated copies equal. Here the mask
of element ``(row, position, feature)`` of a hidden state ``[batch, seq, features]`` is::

    index = (row * SEQ + position) * FEATURES + feature      # global coordinates, global sizes
    keep  = hash32(index ^ key) >= p * 2^32                    # (a second round mixes in index // 2^32)
    key   = hash32(hash32(hash32(seed ^ 0x9E3779B9) ^ step) ^ layer)

(``hash32`` is Wellons' ``lowbias32``), and an attention-probability element ``(row, head, q, k)``
of ``[batch, heads, seq, seq]`` uses ``((row * HEADS + head) * SEQ + q) * SEQ + k``. The kept
elements are scaled by ``1 / (1 - p)``, as ``nn.Dropout`` does.

Who says where a local tensor sits: in one process nobody (``rows = arange(b)``, the whole
sequence and features; ``step`` counts this layer's training forwards, one per step); inside
the engine the ``Coordinates`` it sets around each microbatch's forward and backward
(``colab_kit.dropout.DropoutLayout.at``), from the dp rank, the microbatch, the tensor plan's split
of the residual stream (``hidden_axes``, ``token_axes``, ``dropout_rows``) and its head split
(``head_axes``, and sp under Ulysses), and sp's global positions. They are held in a
``contextvars.ContextVar`` (``at``, ``current``), not a module global: two engines in two threads
each see their own, and a recomputed block runs again under the coordinates of its first forward.

Worked example: GPT, d_model=8, a global batch of 4 rows, block 0's MLP dropout (layer 1)::

    one process                 x [4, T, 8]: rows 0..3, features 0..7, mask M [4, T, 8]
    dp=2, tp=2 (1d), rank 2     dp 1, x [2, T, 8]: rows 2..3 -> M[2:4] (its tp twin, rank 3, the same)
    tp=4 (2d, q=2), rank 2      grid row 1, column 0: x [2, T, 4] -> M[2:4, :, 0:4]
    sp=2 (ring), rank 1         tokens [2 3 4 5] of T=8 (zigzag) -> M[:, 2:6]

``layout_invariant(model)`` numbers every dropout of a model (``layer`` = its order among the
model's dropouts) and swaps each ``nn.Dropout`` for this one; the built-in models call it
themselves, and ``ck.boost`` calls it on every model, so a Hugging Face model trained in one
process must be passed through it too to see the engine's masks. Its cost is measured in
``bench/models.py`` (against ``nn.Dropout``).
"""
from __future__ import annotations

import functools

import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from contextvars import ContextVar

import torch
import torch.nn as nn

from ..policy import policy_for

__all__ = ["Dropout", "layout_invariant", "keep_mask", "attention_dropout", "Coordinates", "at", "current",
           "HF_ATTENTION", "has_dropout", "attention_prob_dropout", "hidden_dropout", "attention_keep"]

_M32 = 0xFFFFFFFF


def _hash32(x):
    """Wellons' lowbias32 on int64 tensors (or ints) holding unsigned 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32  # wraps past 2**63 in int64; the low 32 bits are exact
    return x ^ (x >> 16)


def _hash32_lanes(x: torch.Tensor) -> torch.Tensor:
    """``_hash32`` on int32 tensors holding the same 32 bits (products wrap; shifts masked to be logical):
    twice as few bytes as int64, the speed of ``torch.bernoulli``."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - 2 ** 32)
    return x ^ ((x >> 16) & 0xFFFF)


def _key(seed: int, step: int, layer: int) -> int:
    return _hash32(_hash32(_hash32((seed ^ 0x9E3779B9) & _M32) ^ (step & _M32)) ^ (layer & _M32))


def keep_mask(index: torch.Tensor, p: float, seed: int, step: int, layer: int) -> torch.Tensor:
    """Bool tensor: which elements of global linear ``index`` a dropout of ``p`` keeps.

    ``h = hash32(index mod 2^32 ^ key)``, and for an index of 2^32 or more ``h = hash32(h ^ index // 2^32)``;
    kept where ``h >= p 2^32``. An int32 ``index`` (a global tensor under 2^31 elements) takes the fast path
    with the same bits."""
    k, thr = _key(seed, step, layer), int(round(p * 2 ** 32))
    if index.dtype == torch.int32:
        h = _hash32_lanes(index ^ (k - 2 ** 32 if k >= 2 ** 31 else k))
        return (h ^ -2 ** 31) >= thr - 2 ** 31  # unsigned compare through the flipped sign bit
    hi = index >> 32
    h = _hash32((index & _M32) ^ k)
    if bool((hi != 0).any()):
        h = torch.where(hi == 0, h, _hash32(h ^ hi))
    return h >= thr


def _index_dtype(total: int) -> torch.dtype:
    return torch.int32 if total < 2 ** 31 else torch.int64


class _Scale(torch.autograd.Function):
    """``x * keep / (1 - p)``, keeping the bool mask (1 byte an element) for backward."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


class Coordinates:
    """Where this rank's local tensors of one microbatch sit in the global ones.

    ``rows``: global sample index of each row of the residual stream (dim 0); ``token_rows``: those
    of the tensors inside attention (they differ only in 3D); ``positions(t)``: the global position of
    each of ``t`` local tokens; ``features`` / ``heads``: ``(block, blocks)`` of the contiguous split of
    the last dim / of the heads. In one process: everything whole.
    """

    def __init__(self, step: int, rows=None, token_rows=None, positions=None, features=(0, 1), heads=(0, 1),
                 batch: int = 0):
        self.step, self.rows, self.token_rows = step, rows, token_rows if token_rows is not None else rows
        self.batch = batch  # rows of the global batch (0: unknown, the local count)
        self._positions, self.features, self.heads = positions, features, heads

    def positions(self, t: int, device) -> tuple[torch.Tensor, int]:
        """(global positions of ``t`` local tokens, the global sequence length)."""
        if self._positions is None:
            return torch.arange(t, device=device), t
        return self._positions(t)


_COORDINATES: ContextVar[Coordinates | None] = ContextVar("colab_kit_dropout_coordinates", default=None)
"""The coordinates of the microbatch running now, in this thread's context (``at`` sets them)."""


def current() -> Coordinates | None:
    """The coordinates the engine set for the microbatch running now (None: one process)."""
    return _COORDINATES.get()


@contextmanager
def at(coordinates: Coordinates | None):
    """Run the block under ``coordinates`` (None: one process), then give back what was set before, so
    the engine's ``DropoutLayout.at`` and a recomputation's (``colab_kit.recompute``) nest."""
    token = _COORDINATES.set(coordinates)
    try:
        yield
    finally:
        _COORDINATES.reset(token)


def _rows(c: Coordinates | None, b: int, token: bool, device, where: str) -> torch.Tensor:
    rows = None if c is None else (c.token_rows if token else c.rows)
    if rows is None:
        return torch.arange(b, device=device)
    if rows.numel() != b:
        raise RuntimeError(f"layout-invariant dropout at {where} got {b} rows where the engine's microbatch "
                           f"has {rows.numel()} on this rank: a dropout sits where colab_kit does not know the "
                           f"layout (only on hidden states [batch, seq, features] and attention probabilities)")
    return rows.to(device)


class Dropout(nn.Dropout):
    """``nn.Dropout`` with a layout-invariant mask (see the module docstring); ``layer`` is its number
    among the model's dropouts (``layout_invariant`` sets it), ``seed`` the mask's seed."""

    layer = 0
    seed = 0
    calls = 0  # training forwards in one process: the step there

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        c = current()
        step = self.calls if c is None else c.step
        if c is None:
            self.calls += 1
        return hidden_dropout(x, self.p, self.seed, step, self.layer, c, where=f"dropout {self.layer}")


def hidden_dropout(x, p, seed, step, layer, c=None, where="dropout"):
    """Layout-invariant dropout of a hidden state ``[batch, seq, features]`` (or ``[batch, features]``)."""
    if p >= 1.0:
        return x * 0.0
    dev = x.device
    b, f = x.shape[0], x.shape[-1]
    rows = _rows(c, b, False, dev, where)
    blk, nblk = c.features if c is not None else (0, 1)
    nf = f * nblk
    t = math.prod(x.shape[1:-1])
    pos, seq = c.positions(t, dev) if c is not None else (torch.arange(t, device=dev), t)
    batch = b if c is None else c.batch or int(rows.max()) + 1  # global rows: the index's range
    dt = _index_dtype(batch * seq * nf)
    feats = torch.arange(blk * f, (blk + 1) * f, device=dev, dtype=dt)
    if x.dim() == 2:
        index = rows.to(dt)[:, None] * nf + feats
    else:
        index = ((rows.to(dt)[:, None, None] * seq + pos.to(dev, dt)[None, :, None]) * nf + feats).reshape(
            (b,) + tuple(x.shape[1:-1]) + (f,))
    return _Scale.apply(x, keep_mask(index, p, seed, step, layer), 1.0 / (1.0 - p))


@dataclass
class _Numbered:
    """An attention module's place among the model's dropouts: its number, its masks' seed, and how many
    times it dropped outside the engine's step (the step count of one process)."""

    layer: int
    seed: int = 0
    calls: int = 0


_ATTENTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per attention module numbered by ``layout_invariant``: its ``_Numbered`` (kept here, not on the module)."""


def attention_number(module: nn.Module) -> tuple[int, int]:
    """``(layer, seed)`` of an attention module ``layout_invariant`` numbered."""
    n = _ATTENTIONS.get(module)
    if n is None:
        raise RuntimeError(f"this {type(module).__name__} has no layout-invariant dropout number: its model goes "
                           "through ck.models.layout_invariant(model) (ck.boost does it) before it drops")
    return n.layer, n.seed


def attention_dropout(probs: torch.Tensor, p: float, layer: int, seed: int = 0, calls_from=None) -> torch.Tensor:
    """Layout-invariant dropout of attention probabilities ``[batch, heads, seq, seq]`` of whole sequences
    (sp's ring draws its blocks with ``attention_keep``). ``calls_from``: the module whose ``calls`` counts
    the step in one process."""
    if p == 0.0:
        return probs
    c = current()
    if c is None:
        numbered = _ATTENTIONS.get(calls_from) if calls_from is not None else None
        step = numbered.calls if numbered is not None else 0
        if numbered is not None:
            numbered.calls += 1
    else:
        step = c.step
    b, h, tq, tk = probs.shape
    dev = probs.device
    keep = attention_keep(c, step, p, layer, seed, b, h, torch.arange(tq, device=dev), torch.arange(tk, device=dev),
                          tk, dev)
    return _Scale.apply(probs, keep, 1.0 / (1.0 - p))


def attention_keep(c, step, p, layer, seed, b, h, q_pos, k_pos, seq, device) -> torch.Tensor:
    """The keep mask ``[b, h, len(q_pos), len(k_pos)]`` of attention probabilities at global query positions
    ``q_pos`` and key positions ``k_pos`` of a ``seq``-token sequence: one block of the whole-sequence mask
    (the ring's blocks draw exactly the mask eager attention of the whole sequence draws)."""
    rows = _rows(c, b, True, device, f"attention dropout {layer}")
    blk, nblk = c.heads if c is not None else (0, 1)
    batch = b if c is None else c.batch or int(rows.max()) + 1  # global rows: the index's range
    dt = _index_dtype(batch * h * nblk * seq * seq)
    heads = torch.arange(blk * h, (blk + 1) * h, device=device, dtype=dt)
    index = (((rows.to(dt)[:, None, None, None] * (h * nblk) + heads[None, :, None, None]) * seq
              + q_pos.to(device, dt)[:, None]) * seq + k_pos.to(device, dt))
    return keep_mask(index, p, seed, step, layer)


HF_ATTENTION = "colab_kit_dropout"
"""The name under which ``layout_invariant`` registers eager attention with this dropout in transformers."""

_HF_PROB_FIELDS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")


def _register_hf() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        if attention_mask is not None:
            mask = attention_mask[:, :, :, :key.shape[-2]]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        elif getattr(module, "is_causal", True) and query.shape[2] > 1:  # a block called alone (a pipeline stage)
            tq, tk = query.shape[2], key.shape[2]
            causal = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
            scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        if module.training and dropout:
            probs = attention_dropout(probs, dropout, *attention_number(module), calls_from=module)
        return (probs @ value).transpose(1, 2).contiguous(), probs

    AttentionInterface.register(HF_ATTENTION, attention)
    AttentionMaskInterface.register(HF_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return HF_ATTENTION


def layout_invariant(model: nn.Module, seed: int | None = None, policy=None, undo: list | None = None) -> nn.Module:
    """Number every dropout of ``model`` in module order and make it layout-invariant, in place.

    ``nn.Dropout`` modules become ``Dropout`` (same ``p``); a Hugging Face model whose config has an
    attention-probability dropout (``attn_pdrop``, ``attention_dropout``) gets transformers' eager attention
    with this dropout (``HF_ATTENTION``) on each attention the policy names. ``seed``: the masks' seed
    (None keeps each dropout's own, 0 for a new one; the built-in models use their config's ``seed``).
    Calling it twice changes
    nothing; two models built alike get the same numbers::

        ref = GPT2LMHeadModel(cfg); ck.models.layout_invariant(ref)   # one process, the engine's masks
        engine = ck.boost(GPT2LMHeadModel(cfg), opt, config)          # boost does the same on its copy

    ``undo``: a list that receives, for each change made to a module of ``model`` or its config, a call that
    puts it back (``engine.close()`` runs them: the user's ``nn.Dropout`` again, without our numbers).
    """
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            if type(m) is nn.Dropout:
                m.__class__ = Dropout
                if undo is not None:
                    undo.append(functools.partial(_plain_dropout, m))
            if isinstance(m, Dropout):
                m.layer, m.seed = n, m.seed if seed is None else seed
                n += 1
    cfg = getattr(model, "config", None)
    if attention_prob_dropout(model) > 0:
        policy = policy_for(model, policy)
        if policy is None:  # a model without a policy (dp / ZeRO only): its attentions are not known
            return model
        for _, att, a in policy.attentions(model):
            if a.hf:
                old = _ATTENTIONS.get(att)
                keep = old.seed if old is not None else 0
                _ATTENTIONS[att] = _Numbered(n, keep if seed is None else seed, old.calls if old is not None else 0)
                n += 1
        if any(a.hf for _, _, a in policy.attentions(model)):
            assert cfg is not None  # a Hugging Face model carries its config
            if undo is not None:
                undo.append(functools.partial(setattr, cfg, "_attn_implementation", cfg._attn_implementation))
            cfg._attn_implementation = _register_hf()
    return model


def _plain_dropout(m: nn.Module) -> None:
    """``m`` a torch ``nn.Dropout`` again, without the numbers ``layout_invariant`` gave it."""
    m.__class__ = nn.Dropout
    for key in ("layer", "seed", "calls"):
        m.__dict__.pop(key, None)


def attention_prob_dropout(model: nn.Module) -> float:
    """A Hugging Face model's attention-probability dropout (its config's ``attn_pdrop`` or
    ``attention_dropout``), 0.0 for another model."""
    cfg = getattr(model, "config", None)
    return max((float(getattr(cfg, f, 0) or 0) for f in _HF_PROB_FIELDS), default=0.0) if cfg is not None else 0.0


def has_dropout(model: nn.Module) -> bool:
    """Whether any dropout of ``model`` drops anything (then the engine sets coordinates per microbatch)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    return attention_prob_dropout(model) > 0

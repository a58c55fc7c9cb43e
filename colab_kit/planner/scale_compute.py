"""One transformer block's compute on one rank, per microbatch: every GEMM at its shape's rate, the rest at HBM.

``block(shape, config, rows, seq, hw)`` gives a ``BlockCost`` in seconds: ``f`` the forward, ``i`` the backward
to the block's input, ``w`` the weights' gradients (zero-bubble's I and W: ``i + w`` is the whole backward),
``attn`` the attention core's forward (what selective recomputation repeats: Korthikanti et al. 2022, scores,
softmax, dropout and the product with V), ``rc`` the recomputation recompute mode ``"full"``,
``"selective"`` or ``"none"`` adds; ``head(...)`` the same for the output head and the loss.

What a block runs, for T tokens on the rank (``rows * seq``, over ``sp`` with ring or Ulysses), hidden h,
inner width f (x2 gated), ``a`` heads of width d, ``tp`` ranks:

- four GEMMs (q/k/v, attention output, MLP up, MLP down), split as the tensor mode splits them: 1D
  column then row shards ((T, 3h/tp, h), (T, h, h/tp), (T, f/tp, h), (T, h, f/tp)); 2D (SUMMA) q steps of
  (M/q, N/q, K/q); 2.5D q steps of (M/(d q), N/q, K/q); 3D one (M/q, N/q, K/q). Backward: dX (m, k, n) and
  dW (k, n, m) of each;
- attention's two batched products per head, (s_q, s, d) and (s_q, d, s), at the same curve with HBM as the
  bound (d = 64..160: memory bound on an A100), their backward twice them; ring: s_q = s / sp; Ulysses: all
  of s, a / sp heads;
- elementwise: softmax and dropout over the scores, 4.5 passes of 2 bytes (fp16) per score forward, twice
  that backward; LayerNorms and bias-dropout-adds, 11 passes over (T, h), replicated across 1D tp ranks
  unless split_gather splits them; bias/GELU and layout copies over the tp shards (6 passes).

Worked example, the 18B row of Table 1 (h 6144, 48 heads, tp 8, 8 rows of 2048 tokens) on an A100::

    >>> from colab_kit.config import ParallelConfig
    >>> from colab_kit.planner.shape import ModelShape
    >>> from colab_kit.planner.hardware import HARDWARE
    >>> c = block(ModelShape(40, 6144, 48, 51200, 2048), ParallelConfig(tp=8, precision="fp16"), 8, 2048,
    ...           HARDWARE["8xA100-80GB"])
    >>> round(c.f * 1e3, 1), round((c.i + c.w) / c.f, 2)         # doctest: +SKIP
    (23.1, 2.03)
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from .shape import ModelShape

__all__ = ["BlockCost", "block", "head", "recompute_mode", "with_recompute"]

_SCORE_PASSES = 4.5  # softmax read + write, dropout read + write + a 1-byte mask, per score element (fp16 units)
_ROW_PASSES = 11.0   # 2 LayerNorms (read, write) + 2 bias-dropout-adds (x, residual, out, mask) over (T, h)
_SHARD_PASSES = 2.0  # bias + GELU (read, write) over (T, f/tp); q/k/v and output layout copies likewise
_KERNELS = 12        # elementwise kernels of a block's forward (twice that backward)


def recompute_mode(config) -> str:
    """``config.recompute`` as a mode: True -> "full", False -> "none", or the string it already is."""
    r = config.recompute
    if r is True:
        return "full"
    if r is False or r is None:
        return "none"
    return str(r)


@dataclass(frozen=True)
class BlockCost:
    """Seconds of one block (or the head) on one rank for one microbatch (see the module docstring)."""
    f: float
    i: float
    w: float
    attn: float = 0.0
    rc: float = 0.0


def _splits(config, m: float, n: float, k: float) -> tuple[float, float, float, float]:
    """``(m, n, k, count)`` of the local products one (m, n, k) GEMM becomes under the tensor mode."""
    tp, q, mode = config.tp, config.tp_q, config.tp_mode
    if tp == 1:
        return m, n, k, 1.0
    if mode == "2d":
        return m / q, n / q, k / q, q
    if mode == "2.5d":
        return m / (config.tp_depth * q), n / q, k / q, q
    if mode == "3d":
        return m / q, n / q, k / q, 1
    raise AssertionError(mode)


def _gemm(hw: Hardware, p: str, config, m: float, n: float, k: float, column: bool) -> tuple[float, float, float]:
    """(forward, dX, dW) seconds of one weight GEMM (m tokens, n outputs, k inputs) on this rank; in 1D a
    column-parallel one splits n, a row-parallel one k."""
    if config.tp_mode == "1d":
        n, k = (n / config.tp, k) if column else (n, k / config.tp)
        lm, ln, lk, c = m, n, k, 1.0
    else:
        lm, ln, lk, c = _splits(config, m, n, k)
    return (hw.gemm_seconds(lm, ln, lk, p, c), hw.gemm_seconds(lm, lk, ln, p, c), hw.gemm_seconds(lk, ln, lm, p, c))


def block(shape: ModelShape, config, rows: float, seq: int, hw: Hardware) -> BlockCost:
    """One block's ``BlockCost`` for ``rows`` sequences of ``seq`` tokens on one rank (module docstring)."""
    p = config.precision
    size = 4 if p == "fp32" else 2
    h, tp, sp = shape.hidden, config.tp, config.sp
    ring_or_ulysses = sp > 1 and config.sp_mode in ("ring", "ulysses")
    tokens = rows * seq / (sp if ring_or_ulysses else 1)
    ff = shape.d_ff * (2 if shape.gated else 1)
    gemms = [_gemm(hw, p, config, tokens, shape.qkv_out, h, True), _gemm(hw, p, config, tokens, h, h, False),
             _gemm(hw, p, config, tokens, ff, h, True), _gemm(hw, p, config, tokens, h, shape.d_ff, False)]
    f = sum(g[0] for g in gemms)
    dx = sum(g[1] for g in gemms)
    dw = sum(g[2] for g in gemms)
    # attention's core: heads on this rank, queries per head
    heads = shape.heads / tp / (sp if config.sp_mode == "ulysses" and sp > 1 else 1)
    s_q = seq / sp if (config.sp_mode == "ring" and sp > 1) else seq
    d = shape.head_dim
    products = (hw.gemm_seconds(s_q, seq, d, p, rows * heads) + hw.gemm_seconds(s_q, d, seq, p, rows * heads))
    scores = rows * heads * s_q * seq
    softmax = hw.stream_seconds(_SCORE_PASSES * scores * size, 2)
    attn = products + softmax
    # elementwise over the rows: replicated over 1D tp ranks unless split_gather splits the sequence
    split_rows = tp if (config.tp_mode != "1d" or config.sp_mode == "split_gather") else 1
    row_bytes = _ROW_PASSES * tokens * h * size / split_rows
    shard_bytes = _SHARD_PASSES * tokens * (shape.d_ff + shape.qkv_out + h) * size / tp
    elem = hw.stream_seconds(row_bytes + shard_bytes, _KERNELS)
    forward = f + attn + elem
    backward_input = dx + 2 * attn + 2 * elem
    return BlockCost(f=forward, i=backward_input, w=dw, attn=attn, rc=0.0)


def with_recompute(cost: BlockCost, mode: str) -> BlockCost:
    """``cost`` with what ``mode`` recomputes in backward: the whole forward ("full"), attention's core
    ("selective"), nothing ("none")."""
    rc = {"full": cost.f, "selective": cost.attn}.get(mode, 0.0)
    return BlockCost(cost.f, cost.i, cost.w, cost.attn, rc)


def head(shape: ModelShape, config, rows: float, seq: int, hw: Hardware) -> BlockCost:
    """The output head (tokens x vocab / tp logits) and the cross-entropy over them, kept in fp32."""
    p = config.precision
    ring_or_ulysses = config.sp > 1 and config.sp_mode in ("ring", "ulysses")
    tokens = rows * seq / (config.sp if ring_or_ulysses else 1)
    v, h = shape.vocab, shape.hidden
    if config.tp_mode == "1d":
        f, dx, dw = (hw.gemm_seconds(tokens, v / config.tp, h, p), hw.gemm_seconds(tokens, h, v / config.tp, p),
                     hw.gemm_seconds(h, v / config.tp, tokens, p))
    else:
        f, dx, dw = _gemm(hw, p, config, tokens, v, h, True)
    loss = hw.stream_seconds(5 * tokens * v / config.tp * 4, 4)  # fp32 logits: max, exp, sum, grad
    return BlockCost(f=f + 0.6 * loss, i=dx + 0.4 * loss, w=dw)

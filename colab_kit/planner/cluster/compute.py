"""One transformer block's compute on one rank, per microbatch: every GEMM at its shape's rate, the rest at HBM.

``block(shape, config, rows, seq, hw)`` gives a ``BlockCost`` in seconds: ``f`` the forward, ``i`` the backward
to the block's input, ``w`` the weights' gradients (zero-bubble's I and W: ``i + w`` is the whole backward),
``attn`` the attention core's forward (scores, softmax, dropout and the product with V: what Korthikanti et
al. 2022's selective recomputation repeats; ``repeat`` where the kernel repeats otherwise), ``op`` what
per-op selective recomputation repeats (torchtitan's: every second matmul of the block's forward and every
elementwise op, the attention kernel kept but under ring), ``rc`` the recomputation recompute mode ``"full"``,
``"selective"``, ``"op"`` or ``"none"`` adds; ``head(...)`` the same for the
output head and the loss.

What a block runs, for T tokens on the rank (``rows * seq``, over ``sp`` with ring or Ulysses), hidden h,
inner width f (x2 gated), ``a`` heads of width d, ``tp`` ranks:

- four GEMMs (q/k/v, attention output, MLP up, MLP down), split as the tensor mode splits them: 1D
  column then row shards ((T, 3h/tp, h), (T, h, h/tp), (T, f/tp, h), (T, h, f/tp)); 2D (SUMMA) q steps of
  (M/q, N/q, K/q); 2.5D q steps of (M/(d q), N/q, K/q); 3D one (M/q, N/q, K/q). Backward: dX (m, k, n) and
  dW (k, n, m) of each;
- attention's core, ``a`` heads on the rank (``a / tp``; Ulysses ``a / (tp sp)``) of ``s_q`` queries (ring:
  ``s / sp``, else ``s``) over ``s`` keys, priced by the preset's kernel (``Hardware.attention``):

  - ``"unfused"`` (Megatron-LM 2021, the Table 1 runs): two batched products per head, (s_q, s, d) and
    (s_q, d, s), at the GEMM curve with HBM as the bound (d = 64..160: memory bound on an A100), their
    backward twice them, and softmax and dropout over the whole score matrix through HBM (below); no causal
    halving;
  - ``"flash"`` (FlashAttention-2, what torch's ``F.scaled_dot_product_attention`` runs): FLOPs
    ``4 rows a s_q s d`` forward (QK^T and PV), halved for a causal model (``ModelShape.causal``; ring's
    zigzag layout keeps the halving even), backward 2.5 times that (Dao 2023, Sec. 4.1: 5 products against
    the forward's 2, the scores recomputed), at ``attention_efficiency`` (forward, backward) of the peak, no
    faster than HBM streams q, k, v, o (and backward dO, dq, dk, dv) once: no score touches HBM.
    Selective recomputation repeats the forward kernel (the engine checkpoints SDPA) except under ring,
    whose backward already rebuilds its blocks (nothing repeated);

- elementwise (``elementwise``): ("unfused") softmax and dropout over the scores, 4.5 passes of 2 bytes (fp16)
  per score forward, twice that backward; the rest by the block's family and the stack's
  ``Stack.elementwise`` (``_PASSES``: values read or written per element of each width, forward; backward
  twice), the (T, h) passes replicated across 1D tp ranks unless split_gather splits them:

  ======================  =====  =====================  ======================  ========  ======  ======
  family, kernels         (T,h)  q (T, a d / tp)        k, v (T, a_kv d / tp)   (T,f/tp)  out     kernels
  ======================  =====  =====================  ======================  ========  ======  ======
  GPT fused (Megatron)    11     2                      2 each                  2         2       12
  GPT eager (PyTorch)     15     2                      2 each                  2         2       12
  Llama fused (TE)        10     2 (RoPE)               2 (k's RoPE)            3         0       10
  Llama eager (HF, PyTorch) 42   10 RoPE + 2 repeat_kv  10 (k's RoPE) + 2       5         2       33
  ======================  =====  =====================  ======================  ========  ======  ======

  A GPT's (T, h): two LayerNorms read and write (4), two bias-dropout-adds (x, residual, out, a 1-byte mask:
  7) fused; eager adds a separate dropout (2.5 each) and residual add (3 each). A Llama block (gated and
  rotary: Llama, Mistral, Qwen, Mixtral): eager RMSNorm as Hugging Face writes it, in 2-byte units: the
  upcast to fp32 (3), its square (4), the mean (2), the product with rsqrt (4), the cast back (3), the weight
  (2), 18 a norm; two residual adds (6). RoPE as ``q * cos + rotate_half(q) * sin``: the product, the
  half-negation and concatenation, the second product and the sum, 10 over q and over k. SwiGLU: SiLU (2)
  then the product (3). ``repeat_kv`` copies k and v to every query head (read 1 + write 1 each) where
  grouped; the attention output's transpose back (2). Fused kernels read and write each once.

Worked example, the 18B row of Table 1 (h 6144, 48 heads, tp 8, 8 rows of 2048 tokens) on an A100, its
attention core as Megatron-LM ran it (unfused) and as FlashAttention-2 would (6 heads x 8 rows x 2048^2 x
128 x 4 / 2 = 51.5 GFLOP forward at 73% of 312 TFLOP/s: 0.23 ms)::

    >>> from colab_kit.config import ParallelConfig
    >>> from colab_kit.planner.shape import ModelShape
    >>> from colab_kit.planner.cluster.hardware import HARDWARE
    >>> shape, cfg = ModelShape(40, 6144, 48, 51200, 2048), ParallelConfig(tp=8, precision="fp16")
    >>> a100 = HARDWARE["8xA100-80GB"].with_stack("megatron-lm-2021")     # its fused elementwise kernels
    >>> old, new = (block(shape, cfg, 8, 2048, a100.with_attention(k)) for k in ("unfused", "flash"))
    >>> round(old.f * 1e3, 2), round(old.attn * 1e3, 2), round(new.f * 1e3, 2), round(new.attn * 1e3, 2)
    (11.58, 2.06, 9.76, 0.23)
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from ..shape import ModelShape

__all__ = ["BlockCost", "attention_note", "block", "core", "elementwise", "family", "flash", "gemm", "head",
           "recompute_mode", "with_recompute"]

_SCORE_PASSES = 4.5  # softmax read + write, dropout read + write + a 1-byte mask, per score element (fp16 units)
_PASSES = {  # (family, stack.elementwise) -> passes over (T, h), q, k and v (each), (T, f), out; kernels
    ("gpt", "fused"): (11.0, 2.0, 2.0, 2.0, 2.0, 12),
    ("gpt", "eager"): (15.0, 2.0, 2.0, 2.0, 2.0, 12),
    ("llama", "fused"): (10.0, 2.0, 2.0, 3.0, 0.0, 10),
    ("llama", "eager"): (42.0, 10.0, 10.0, 5.0, 2.0, 33),
}
_REPEAT_KV = 2.0     # eager repeat_kv: k and v read once (kv width), written once per query head (q width)


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
    repeat: float | None = None
    """What selective recomputation repeats (None: ``attn``, the core's forward)."""
    op: float | None = None
    """What per-op selective recomputation repeats (None: half the forward less the core, an MoE block)."""
    gemms: tuple = (0.0, 0.0)
    """Seconds of the block's weight GEMMs, (forward, backward): what tp communication can hide under."""
    tail: float = 0.0
    """Forward seconds of the block's last GEMM (fc2, down): what torch's early stop does not replay."""


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


def gemm(hw: Hardware, p: str, config, m: float, n: float, k: float, column: bool) -> tuple[float, float, float]:
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
    h, sp = shape.hidden, config.sp
    ring_or_ulysses = sp > 1 and config.sp_mode in ("ring", "ulysses")
    tokens = rows * seq / (sp if ring_or_ulysses else 1)
    ff = shape.d_ff * (2 if shape.gated else 1)
    gemms = [gemm(hw, p, config, tokens, shape.qkv_out, h, True), gemm(hw, p, config, tokens, h, h, False),
             gemm(hw, p, config, tokens, ff, h, True), gemm(hw, p, config, tokens, h, shape.d_ff, False)]
    f = sum(g[0] for g in gemms)
    dx = sum(g[1] for g in gemms)
    dw = sum(g[2] for g in gemms)
    attn, attn_b, repeat = core(shape, config, rows, seq, hw)
    elem = elementwise(shape, config, tokens, hw)
    forward = f + attn + elem
    backward_input = dx + attn_b + 2 * elem
    # per-op selective (torchtitan): every second matmul of the forward in issue order runs again, and every
    # elementwise op; a gated block issues q, k, v, o, gate, up, down (k, o, up again), a GPT qkv, proj, fc1,
    # fc2 (proj again; fc2's output is saved by nothing, and torch's checkpoint stops once the last saved tensor
    # is rebuilt). Ring attention runs inside its own autograd function: its kernels run again too.
    if shape.gated:
        again = (gemm(hw, p, config, tokens, shape.n_kv * shape.head_dim, h, True)[0] + gemms[1][0]
                 + gemm(hw, p, config, tokens, shape.d_ff, h, True)[0])
    else:
        again = gemms[1][0]
    if ring_or_ulysses and config.sp_mode == "ring":
        again += attn
    return BlockCost(f=forward, i=backward_input, w=dw, attn=attn, rc=0.0, repeat=repeat, op=again + elem,
                     gemms=(f, dx + dw), tail=gemms[3][0])


def family(shape: ModelShape) -> str:
    """The block's elementwise family: "llama" (a gated MLP and rotary positions: Llama, Mistral, Qwen, Mixtral,
    DeepSeek: RMSNorm, RoPE, SwiGLU), else "gpt" (LayerNorm, GELU, biases: GPT, BERT, ViT)."""
    return "llama" if shape.gated and not shape.positions else "gpt"


def elementwise(shape: ModelShape, config, tokens: float, hw: Hardware) -> float:
    """Forward seconds of a block's elementwise kernels on one rank (module docstring's table) for ``tokens``,
    by the block's ``family`` and the stack's ``elementwise`` ("eager" or "fused"). Backward is twice this.

    >>> from colab_kit.config import ParallelConfig
    >>> from colab_kit.planner.cluster.hardware import HARDWARE
    >>> llama = ModelShape(32, 4096, 32, 128256, 8192, ffn=14336, kv_heads=8, gated=True, positions=False)
    >>> h100, c = HARDWARE["8xH100-SXM"], ParallelConfig(precision="bf16")
    >>> eager, fused = (elementwise(llama, c, 8192, h100.with_stack(elementwise=e)) for e in ("eager", "fused"))
    >>> values = 8192 * (42 * 4096 + 12 * 4096 + 12 * 1024 + 5 * 14336 + 2 * 4096)   # read or written, eager
    >>> eager == h100.stream_seconds(values * 2, 33), round(eager / fused, 1)
    (True, 3.3)
    """
    size = 4 if config.precision == "fp32" else 2
    tp = config.tp
    rows_p, q_p, kv_p, ff_p, out_p, kernels = _PASSES[family(shape), hw.stack.elementwise]
    q_w, kv_w = shape.heads * shape.head_dim, shape.n_kv * shape.head_dim
    if hw.stack.elementwise == "eager" and shape.n_kv < shape.heads:  # repeat_kv copies k and v per query head
        q_p, kv_p = q_p + _REPEAT_KV, kv_p + _REPEAT_KV
    split_rows = tp if (config.tp_mode != "1d" or config.sp_mode == "split_gather") else 1
    if family(shape) == "gpt":  # q, k and v each at their widths (k and v as one: qkv_out less q)
        shards = q_p * q_w + kv_p * (shape.qkv_out - q_w) + ff_p * shape.d_ff + out_p * shape.hidden
    else:
        shards = q_p * q_w + kv_p * kv_w + ff_p * shape.d_ff + out_p * shape.hidden
    values = rows_p * tokens * shape.hidden / split_rows + shards * tokens / tp
    return hw.stream_seconds(values * size, kernels)


def core(shape: ModelShape, config, rows: float, seq: int, hw: Hardware) -> tuple[float, float, float]:
    """``(forward, backward, repeated by selective)`` seconds of attention's core in one block on one rank, by
    the preset's kernel: ``flash(...)``, or unfused (Megatron-LM 2021's kernels: the two batched products per
    head at the GEMM curve, softmax and dropout over the scores through HBM; backward twice the forward). A
    stand-in for ``Hardware`` without ``attention`` (a FLOP counter) is priced unfused, as before."""
    if getattr(hw, "attention", "unfused") == "flash":
        return flash(shape, config, rows, seq, hw)
    p = config.precision
    size = 4 if p == "fp32" else 2
    heads, s_q = _core(shape, config, seq)
    d = shape.head_dim
    products = (hw.gemm_seconds(s_q, seq, d, p, rows * heads) + hw.gemm_seconds(s_q, d, seq, p, rows * heads))
    scores = rows * heads * s_q * seq
    softmax = hw.stream_seconds(_SCORE_PASSES * scores * size, 2)
    attn = products + softmax
    return attn, 2 * attn, attn


def _core(shape: ModelShape, config, seq: int) -> tuple[float, float]:
    """``(heads, s_q)`` of attention's core on one rank: heads over tp (and sp under Ulysses), the queries of
    its ``seq / sp`` tokens under ring (each against all ``seq`` keys), else all of them."""
    sp = config.sp
    heads = shape.heads / config.tp / (sp if config.sp_mode == "ulysses" and sp > 1 else 1)
    s_q = seq / sp if (config.sp_mode == "ring" and sp > 1) else seq
    return heads, s_q


def flash(shape: ModelShape, config, rows: float, seq: int, hw: Hardware) -> tuple[float, float, float]:
    """``(forward, backward, repeated by selective)`` seconds of FlashAttention's core for ``rows`` sequences
    on one rank (module docstring): its FLOPs at ``hw.attention_efficiency`` of the precision's peak, or HBM
    streaming q, k, v, o once where slower, plus one kernel's gap forward and two backward. The head width is
    ``core_width / heads`` (MLA's mean of its q.k and v widths), ``head_dim`` otherwise.

    >>> from colab_kit.config import ParallelConfig
    >>> from colab_kit.planner.cluster.hardware import HARDWARE
    >>> h100 = HARDWARE["8xH100-SXM"]
    >>> f, b, r = flash(ModelShape(1, 4096, 32, 8, 8192), ParallelConfig(precision="bf16"), 1, 8192, h100)
    >>> flops = 4 * 32 * 8192 * 8192 * 128 / 2                     # causal: half the square
    >>> f == flops / (989e12 * 0.34) + 3e-6, b == 2.5 * flops / (989e12 * 0.34) + 6e-6, r == f
    (True, True, True)
    """
    p = config.precision
    heads, s_q = _core(shape, config, seq)
    width = (shape.core_width or shape.hidden) / shape.heads
    flops = 4.0 * rows * heads * s_q * seq * width * (0.5 if shape.causal else 1.0)
    e_f, e_b = hw.attention_efficiency
    size = 4 if p == "fp32" else 2
    q = rows * heads * s_q * width * size             # q (and o, dO, dq: the same shape)
    kv = rows * heads * shape.n_kv / shape.heads * seq * width * size  # k (and v, dk, dv)
    bw = hw.memory_bytes_per_s * hw.hbm_efficiency
    forward = max(flops / (hw.peak(p) * e_f), (2 * q + 2 * kv) / bw) + hw.kernel_seconds
    backward = max(2.5 * flops / (hw.peak(p) * e_b), (4 * q + 4 * kv) / bw) + 2 * hw.kernel_seconds
    ring = config.sp > 1 and config.sp_mode == "ring"  # sequence.ring rebuilds its blocks backward: no repeat
    return forward, backward, 0.0 if ring else forward


def attention_note(hw: Hardware, precision: str) -> str:
    """One line of ``Estimate.assumptions``: the kernel attention's core is priced as, and its source."""
    if hw.attention == "unfused":
        return ("attention unfused (Megatron-LM 2021): batched products at the GEMM curve, softmax and dropout "
                "over the scores through HBM, no causal halving")
    e_f, e_b = hw.attention_efficiency
    return (f"attention fused (FlashAttention): {e_f:g} of the {precision} peak forward, {e_b:g} backward "
            f"({hw.sources.get('attention_efficiency', 'given')}); {hw.sources.get('attention', '')}")


def with_recompute(cost: BlockCost, mode: str, early_stop: bool = False) -> BlockCost:
    """``cost`` with what ``mode`` recomputes in backward: the whole forward ("full"; with ``early_stop``, torch's
    non-reentrant checkpoint, all but its last GEMM, ``cost.tail``), attention's core ("selective":
    ``cost.repeat``, the core's forward unless the kernel says otherwise), every second matmul and every
    elementwise op ("op": ``cost.op``), nothing ("none")."""
    core = cost.attn if cost.repeat is None else cost.repeat
    op = (cost.f - cost.attn) / 2 if cost.op is None else cost.op
    rc = {"full": cost.f - (cost.tail if early_stop else 0.0), "selective": core, "op": op}.get(mode, 0.0)
    return BlockCost(cost.f, cost.i, cost.w, cost.attn, rc, cost.repeat, cost.op, cost.gemms, cost.tail)


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
        f, dx, dw = gemm(hw, p, config, tokens, v, h, True)
    loss = hw.stream_seconds(5 * tokens * v / config.tp * 4, 4)  # fp32 logits: max, exp, sum, grad
    return BlockCost(f=f + 0.6 * loss, i=dx + 0.4 * loss, w=dw)

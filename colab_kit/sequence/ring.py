"""Ring self-attention (Li et al. 2021, arXiv 2105.13120) in the online-softmax form.

Each rank of the ``sp`` axis holds the queries, keys and values of its own tokens
(``[b, heads, t_local, d]``, two chunks in the layout of ``zigzag.py``). The K/V pairs
travel around the ring: at rotation ``i`` rank ``r`` holds the K/V of rank ``r - i`` and
attends its queries to them. The paper's ring kept whole score rows (O(t^2/sp) memory);
here every block is one chunk of queries against one chunk of keys (``c x c`` with
``c = t_local / 2``), and the partial results merge with the log-sum-exp rule::

    L' = L + log(1 + e^(L_b - L))            (torch.logaddexp(L, L_b))
    O' = e^(L - L') O + e^(L_b - L') O_b

so no rank ever holds a score matrix larger than ``c x c`` per head, nor a whole row.

The causal mask goes by global position: chunks are contiguous runs of positions, so a
(query chunk ``a``, key chunk ``b``) block is skipped when ``b > a`` (above the diagonal),
masked with the triangle when ``b == a`` and computed whole when ``b < a``.

Worked example, sp=2, t=8 (chunks of 2 tokens; zigzag: rank 0 holds chunks 0, 3 and
rank 1 chunks 1, 2)::

    rotation 0  rank 0 holds K/V [0, 3]: q0.k0 diag, q0.k3 skip, q3.k0 full, q3.k3 diag
                rank 1 holds K/V [1, 2]: q1.k1 diag, q1.k2 skip, q2.k1 full, q2.k2 diag
    rotation 1  rank 0 holds K/V [1, 2]: q0.k1 skip, q0.k2 skip, q3.k1 full, q3.k2 full
                rank 1 holds K/V [0, 3]: q1.k0 full, q1.k3 skip, q2.k0 full, q2.k3 skip

Three blocks then two on each rank: the zigzag gives every rank the same work.

Overlap: before computing the blocks of rotation ``i`` the rank posts the send of the
K/V it holds to ``r + 1`` and the receive of the next from ``r - 1`` (async p2p, one
``comm.sendrecv``: a batched isend/irecv pair, recorded as ``send@sp`` / ``recv@sp``), and
waits only after its compute. The backward runs the same ring again, recomputing every block from
q, k, v, the saved output and LSE; the dK/dV accumulator of each K/V chunk travels with
it and after the last rotation one more hop delivers it to its owner.

Every step is recorded when a ``RingRecorder`` is passed: which K/V chunks this rank
held at each rotation (what a notebook draws), and when.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import Axis
from .. import comm
from .ring_kernels import block_backward, block_forward, kernel_for
from .zigzag import LAYOUTS, chunk_ids

__all__ = ["RingAttention", "RingRecorder", "ring_attention", "merge_lse", "gather_keys"]


@dataclass
class RingRecorder:
    """The ring's steps on this rank, one event per rotation and pass.

    Each event: ``{"phase": "forward" | "backward", "rotation": i, "rank": r (sp coordinate),
    "holds": [chunk ids of the K/V held], "start", "end" (compute, seconds since the
    recorder was made), "posted": when the next K/V transfer was posted (None at the last
    rotation), "waited": seconds spent waiting for transfers after the compute}``. Rotation
    0 is the rank's own K/V; a forward has ``sp - 1`` rotations after it. On rank 1 of sp=2::

        rec = RingRecorder(); ring_attention(q, k, v, mesh, recorder=rec)
        rec.holds("forward")   # {0: [1, 2], 1: [0, 3]}
    """

    events: list = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, **event) -> None:
        self.events.append(event)

    def holds(self, phase: str = "forward") -> dict[int, list[int]]:
        """Rotation -> K/V chunk ids held, for the last call's ``phase``."""
        return {e["rotation"]: e["holds"] for e in self.events if e["phase"] == phase}


def merge_lse(o, lse, o_b, lse_b):
    """Merge two partial attention results over disjoint keys (``o`` [.., c, d], ``lse`` [.., c]).

    ``L' = L + log(1 + e^(L_b - L))`` is ``logaddexp`` (computed without overflow);
    ``O' = e^(L - L') O + e^(L_b - L') O_b``. ``o is None`` means nothing yet.

    >>> s, v = torch.randn(3, 6, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    >>> o_a, l_a = torch.softmax(s[:, :4], -1) @ v[:4], s[:, :4].logsumexp(-1)
    >>> o_b, l_b = torch.softmax(s[:, 4:], -1) @ v[4:], s[:, 4:].logsumexp(-1)
    >>> torch.allclose(merge_lse(o_a, l_a, o_b, l_b)[0], torch.softmax(s, -1) @ v)
    True
    """
    if o is None:
        return o_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    return torch.exp(lse - new).unsqueeze(-1) * o + torch.exp(lse_b - new).unsqueeze(-1) * o_b, new


def _relation(q_chunk: int, k_chunk: int, causal: bool = True) -> str:
    """How a query chunk sees a key chunk under the causal mask (chunks are runs of positions);
    without one, every block is whole."""
    if not causal:
        return "full"
    return "skip" if k_chunk > q_chunk else "diag" if k_chunk == q_chunk else "full"


def _scores(q, k, scale, diag: bool, keys=None):
    """The one ``c x c`` score block per head; the upper triangle at ``-inf`` on the diagonal; keys where
    ``keys [b, c]`` is False (padding) at the dtype's lowest finite value, so a block with no real key
    merges to nothing instead of to NaN."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diag:
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if keys is not None:
        s = s.masked_fill(~keys[:, None, None, :], torch.finfo(s.dtype).min)
    return s


def _block_forward(q, k, v, scale, diag, keys=None, keep=None):
    """One block's output and LSE; ``keep``: ``(mask, 1/(1-p))`` of attention dropout on its probabilities
    (the normaliser stays the undropped one, so the merge of blocks is unchanged: flash attention's way)."""
    s = _scores(q, k, scale, diag, keys)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if keep is not None:
        p = p * keep[0] * keep[1]
    return torch.matmul(p, v), lse


def _block_backward(q, k, v, do, lse, delta, scale, diag, keys=None, keep=None):
    """Flash-attention's backward of one block, from the row's final LSE and ``delta = rowsum(dO * O)``
    (with dropout, ``O`` is the dropped output and ``dP`` is masked like ``P`` was)."""
    p = torch.exp(_scores(q, k, scale, diag, keys) - lse.unsqueeze(-1))  # this block's share of the softmax
    dp = torch.matmul(do, v.transpose(-2, -1))
    if keep is not None:
        drop = keep[0] * keep[1]
        dv, dp = torch.matmul((p * drop).transpose(-2, -1), do), dp * drop
    else:
        dv = torch.matmul(p.transpose(-2, -1), do)
    ds = p * (dp - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pack_kv(k, v, dtype):
    """K and V in one buffer (one message per rotation) and the function that views them back out of it (or out
    of a gradient buffer of the same shape): stacked ``[2, b, h, t, d]`` when their widths agree, else side by
    side ``[b, h, t, d_k + d_v]`` (DeepSeek's multi-head latent attention: d_k 192, d_v 128)."""
    if v.shape == k.shape:
        return torch.stack([k, v]).to(dtype).contiguous(), lambda buf: (buf[0], buf[1])
    dk = k.shape[-1]
    return torch.cat([k, v], dim=-1).to(dtype).contiguous(), lambda buf: (buf[..., :dk], buf[..., dk:])


def _pass_on(buf, mesh, axis, msg_tag, tag):
    """Post the send of ``buf`` to the next rank and the receive of the previous rank's; -> (incoming, pending)."""
    n, r = mesh.size(axis), mesh.rank(axis)
    incoming = torch.empty_like(buf)
    return incoming, comm.sendrecv(buf, incoming, mesh, axis, (r + 1) % n, (r - 1) % n, msg_tag=msg_tag, tag=tag)


def _wait(pending) -> float:
    t0 = time.perf_counter()
    for p in pending:
        p.wait()
    return time.perf_counter() - t0


class RingAttention(torch.autograd.Function):
    """Ring self-attention over ``axis``; ``apply(q, k, v, mesh, axis, layout, recorder, causal, keys)``.

    ``q, k, v``: this rank's tokens, ``[b, heads, t_local, d]`` in ``layout``; returns the
    attention output of those tokens, same shape. Saves q, k, v, the output and the LSE
    (``[b, heads, t_local]``) only. With equal q/k and v widths and no key mask or dropout, each block runs
    through a fused kernel of torch's in q's dtype (``ring_kernels``: flash attention on CPU, FlashAttention-2
    or memory-efficient attention on CUDA once probed; no score block is ever made; blocks merge by their LSE
    in at least fp32; ``colab_kit.observe.throughput.flop_counter()`` counts the CPU kernel's FLOPs, a plain
    ``FlopCounterMode`` does not in torch 2.13); otherwise explicit blocks in at least fp32.
    ``causal=False``: bidirectional (BERT's); ``keys``: every rank's key-padding mask ``[sp, b, t_local]``
    (True: a real token), indexed by the rank whose K/V a rotation holds, or None. ``drop(q_chunk, k_chunk)``: attention
    dropout's ``(keep mask, 1/(1-p))`` of the block of those global chunk ids, or None.
    """

    @staticmethod
    def forward(ctx, q, k, v, mesh, axis, layout, recorder, causal=True, keys=None, drop=None):
        n, r = mesh.size(axis), mesh.rank(axis)
        acc = torch.promote_types(q.dtype, torch.float32)
        fused = kernel_for(q, v, keys, drop)           # a block through a fused kernel, in q's dtype (ring_kernels)
        aux: dict = {}                                 # what a CUDA kernel's backward needs of its forward, per block
        work = q.dtype if fused else acc
        c, scale = q.shape[2] // 2, q.shape[-1] ** -0.5
        q_ids = chunk_ids(r, n, layout)
        qs = q.to(work).split(c, dim=2)
        kv, kv_of = _pack_kv(k, v, work)               # one buffer, one message per rotation
        state = [(None, None), (None, None)]           # (O, LSE) per query chunk
        for i in range(n):
            src = (r - i) % n                          # whose K/V this rank holds now
            incoming, pending = _pass_on(kv, mesh, axis, i, "ring kv") if i < n - 1 else (None, [])
            posted = recorder.now() if recorder is not None and pending else None
            start = recorder.now() if recorder is not None else 0.0
            k_ids = chunk_ids(src, n, layout)
            for a, qa in enumerate(qs):
                for b, kb in enumerate(k_ids):
                    rel = _relation(q_ids[a], kb, causal)
                    if rel != "skip":
                        ks = slice(b * c, (b + 1) * c)
                        km = keys[src][:, ks] if keys is not None else None
                        keep = drop(q_ids[a], kb) if drop is not None else None
                        kb_, vb_ = kv_of(kv)
                        if fused:  # the kernel's output and LSE; merged in acc
                            o_b, l_b, aux[i, a, b] = block_forward(fused, qa, kb_[:, :, ks], vb_[:, :, ks],
                                                                   rel == "diag", scale)
                            o_b, l_b = o_b.to(acc), l_b.to(acc)
                        else:
                            o_b, l_b = _block_forward(qa, kb_[:, :, ks], vb_[:, :, ks], scale, rel == "diag", km,
                                                      keep)
                        state[a] = merge_lse(*state[a], o_b, l_b)
            end = recorder.now() if recorder is not None else 0.0
            waited = _wait(pending)
            if recorder is not None:
                recorder.add(phase="forward", rotation=i, rank=r, holds=list(k_ids), start=start, end=end,
                             posted=posted, waited=waited)
            kv = incoming if incoming is not None else kv
        (o0, l0), (o1, l1) = state
        assert o0 is not None and l0 is not None and o1 is not None and l1 is not None  # each met its own keys
        out = torch.cat([o0, o1], dim=2)
        lse = torch.cat([l0, l1], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.axis, ctx.layout, ctx.recorder = mesh, axis, layout, recorder
        ctx.causal, ctx.keys, ctx.drop, ctx.fused, ctx.aux = causal, keys, drop, fused, aux
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, axis, layout, recorder = ctx.mesh, ctx.axis, ctx.layout, ctx.recorder
        causal, keys, drop = ctx.causal, ctx.keys, ctx.drop
        n, r = mesh.size(axis), mesh.rank(axis)
        acc, fused = out.dtype, ctx.fused
        work = q.dtype if fused else acc
        c, scale = q.shape[2] // 2, q.shape[-1] ** -0.5
        q_ids = chunk_ids(r, n, layout)
        do = dout.to(acc)
        delta = (do * out).sum(-1)                     # rowsum(dO * O): [b, heads, t_local]
        qs, dos = q.to(work).split(c, dim=2), do.to(work).split(c, dim=2)
        outs = out.to(work).split(c, dim=2)            # the fused backward takes the final O and LSE per block
        lses, deltas = lse.split(c, dim=2), delta.split(c, dim=2)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, kv_of = _pack_kv(k, v, work)
        acc_in: torch.Tensor | None = None             # the dK/dV accumulator arriving from r - 1
        acc_pending: list = []
        for i in range(n):
            src = (r - i) % n
            incoming, pending = _pass_on(kv, mesh, axis, 2 * i, "ring kv backward") if i < n - 1 else (None, [])
            posted = recorder.now() if recorder is not None and pending else None
            start = recorder.now() if recorder is not None else 0.0
            k_ids = chunk_ids(src, n, layout)
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # this rank's share of src's dK/dV
            for a in range(2):
                for b, kb in enumerate(k_ids):
                    rel = _relation(q_ids[a], kb, causal)
                    if rel != "skip":
                        ks, qsl = slice(b * c, (b + 1) * c), slice(a * c, (a + 1) * c)
                        km = keys[src][:, ks] if keys is not None else None
                        keep = drop(q_ids[a], kb) if drop is not None else None
                        kb_, vb_ = kv_of(kv)
                        if fused:
                            dq_b, dk_b, dv_b = block_backward(fused, dos[a], qs[a], kb_[:, :, ks], vb_[:, :, ks],
                                                              outs[a], lses[a].to(_lse_dtype(work)), rel == "diag",
                                                              scale, ctx.aux[i, a, b])
                        else:
                            dq_b, dk_b, dv_b = _block_backward(qs[a], kb_[:, :, ks], vb_[:, :, ks], dos[a], lses[a],
                                                               deltas[a], scale, rel == "diag", km, keep)
                        dq[:, :, qsl] += dq_b
                        dk_acc, dv_acc = kv_of(dkv)
                        dk_acc[:, :, ks] += dk_b
                        dv_acc[:, :, ks] += dv_b
            end = recorder.now() if recorder is not None else 0.0
            waited = _wait(acc_pending)                # the accumulator for src, from r - 1's previous step
            if acc_in is not None:
                dkv += acc_in
            if n > 1:                                  # on to r + 1, which holds src's K/V next
                acc_in, acc_pending = _pass_on(dkv, mesh, axis, 2 * i + 1, "ring dkv")
            waited += _wait(pending)
            if recorder is not None:
                recorder.add(phase="backward", rotation=i, rank=r, holds=list(k_ids), start=start, end=end,
                             posted=posted, waited=waited)
            kv = incoming if incoming is not None else kv
        if n > 1:                                      # the last hop brought this rank's own dK/dV
            _wait(acc_pending)
            assert acc_in is not None  # passed on at every rotation
            dkv = acc_in
        dk_all, dv_all = kv_of(dkv)
        return dq.to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype), None, None, None, None, None, None, None


def gather_keys(mask: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """Every rank's key-padding mask ``[b, t_local]`` (True: a real token) -> ``[sp, b, t_local]``, in rank
    order (one small all-gather of bytes; no gradient)."""
    every = comm.all_gather(mask.to(torch.uint8).unsqueeze(0).contiguous(), mesh, axis, 0, tag="key mask")
    return every.bool()


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, axis: str = Axis.SP, *,
                   layout: str = "zigzag", recorder: RingRecorder | None = None, causal: bool = True,
                   mask: torch.Tensor | None = None, keys: torch.Tensor | None = None, drop=None) -> torch.Tensor:
    """Self-attention of the sequence split over ``axis``, by ring self-attention; causal, or bidirectional
    with ``causal=False``, keys masked out where ``mask [b, t_local]`` (this rank's tokens) is False.

    ``q, k, v``: ``[b, heads, t_local, d]``, this rank's ``t_local = t / sp`` tokens in
    ``layout`` (``split_sequence(x, mesh.rank(axis), sp, dim=2)``); returns this rank's
    rows of ``softmax(q k^T / sqrt(d) + causal) v``, in the same layout. On sp=2, t=8,
    rank 0 passes the q, k, v of tokens [0 1 6 7] and gets the output rows of those tokens.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"ring_attention needs q, k of one shape [b, heads, t_local, d] and v of "
                         f"[b, heads, t_local, d_v], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % 2 or q.shape[2] == 0:
        n = mesh.size(axis)
        raise ValueError(f"ring_attention needs this rank's tokens to be two equal chunks, got t_local="
                         f"{q.shape[2]}: the sequence must be a multiple of 2*sp = {2 * n}")
    if keys is None and mask is not None:  # ``keys``: ``gather_keys(mask)`` made once for every layer
        keys = gather_keys(mask, mesh, axis)
    return RingAttention.apply(q, k, v, mesh, axis, layout, recorder, causal, keys, drop)

"""What a mixture of experts adds to ``planner.cluster.price``'s ``price``: the expert GEMMs, the all-to-all, the edp
reduction.

For the fullest rank's ``n_moe`` MoE blocks of ``layers`` (``layers_on_rank``), T tokens of a microbatch on the
rank, hidden h, top-k k, E experts over ``ep`` ranks, expert width f (x2 gated), shared width S. T is the rank's
share of the microbatch's ``rows x seq`` tokens as the engine routes them: under sp (ring, Ulysses; dropless)
each sp rank routes its own ``seq / sp`` tokens of each row, ``T = rows seq / sp``; under 1D tp every tp rank of a
(dp, sp) position routes the same tokens and runs the MoE layer whole (router, shared and routed experts
replicated over tp, no collective of their own), so T is the whole (dp, sp) shard's and the MoE layer's FLOPs
and bytes are *repeated* on each of the tp ranks, not divided by tp (attention and the dense MLPs are split
by tp as for a dense model):

- **compute**: the dense MLP's two GEMMs (split over tp) give way to the router ``(T, E, h)``, the shared
  experts' MLP (both whole on every tp rank) and the routed experts at their grouped sizes: each of the rank's
  ``E / ep`` experts gets ``T k ep / E`` rows (balanced routing: the ep group's ``T k ep`` rows spread over its
  ``E`` experts), ``E / ep`` GEMMs ``(T k ep / E, f, h)`` and ``(T k ep / E, h, f)`` forward, their dX and dW
  backward; the dispatch's permutes (2 passes over ``T k h``) at HBM speed. Forward FLOPs of the routed
  experts per rank and MoE block (``expert_flops``): ``2 T k h f (2 or 3)``, whatever tp is;
- **comm:ep**: the dispatch and combine all-to-alls of ``T k h`` values per rank forward (``dispatch_bytes``:
  ``T k h e`` bytes, under sp ``rows seq k h e / sp``), the two transposes backward, full and per-op
  recomputation replaying the forward's (``colab_kit.expert.layer``), on the ep group (ep folded over the dp x
  sp ranks of a tp position, each tp rank in its own group) as the rank order places it
  (``comm.placement(config, "ep")``: ep is the fastest part of the folded dp x sp block, so an ep group
  of at most ``G / tp`` ranks sits inside a node, NVLink; a larger one crosses nodes, each rank's bytes for
  other nodes on its NIC): nothing hidden (DeepSeek-V3's DualPipe overlaps them; this engine does not);
- **comm:tp** (``tp_share``): an MoE block has attention's tp all-reduces (one forward, one backward in 1D),
  not the dense MLP's two;
- **comm:dp**: dense gradients over dp x sp as for a dense model; the rank's experts' gradients (fp32) over
  ``edp = dp sp / ep`` ranks (``placement(config, "edp")``: ``ep`` ranks apart), hidden behind the last
  microbatch's backward but its last bucket, and their parameters gathered back under ZeRO 1-2.

Worked example: 64 experts of width 1,408 over ep=8 on one DGX H100 node, 4 rows of 4,096 tokens, top-6,
hidden 2,048 in bf16: each all-to-all carries 16,384 x 6 x 2,048 x 2 B = 403 MB per rank, 7/8 of it to the node's
other GPUs over NVLink (450 GB/s each way at 0.7 of it: 1.1 ms), and forward adds the counts' small one::

    >>> from colab_kit.config import ParallelConfig
    >>> from colab_kit.planner.shape import ModelShape
    >>> from colab_kit.planner.cluster.hardware import HARDWARE
    >>> s = ModelShape(layers=28, hidden=2048, heads=16, vocab=102400, seq=4096, ffn=10944, gated=True,
    ...                positions=False, experts=64, top_k=6, d_expert=1408, shared_ffn=2816,
    ...                moe_blocks=tuple(range(1, 28)))
    >>> f, b, n = dispatch_seconds(s, ParallelConfig(dp=8, ep=8, precision="bf16"), 4, 4096, HARDWARE["8xH100-SXM"])
    >>> round(f * 1e3, 1), n                     # counts, dispatch, combine forward; two transposes backward
    (2.3, (3, 2))

The same 4 rows under sp=2 (8 rows a dp rank, half of each on a rank): the same 16,384 tokens a rank, the same
bytes; under tp=2 each tp rank dispatches them all and runs the experts' FLOPs for all of them::

    >>> c = ParallelConfig(dp=8, ep=8, precision="bf16")
    >>> dispatch_bytes(s, c, 4, 4096) == dispatch_bytes(s, c.replace(dp=4, sp=2), 8, 4096) == 16384 * 6 * 2048 * 2
    True
    >>> expert_flops(s, c.replace(tp=2), 4, 4096) == expert_flops(s, c, 4, 4096) == 2 * 16384 * 6 * 3 * 2048 * 1408
    True
"""
from __future__ import annotations

import math

from ...config import Axis
from ..cluster import comm
from ..cluster.compute import BlockCost, gemm, recompute_mode
from ..cluster.hardware import Hardware
from ..cluster.stack import plain_left_out
from ..cluster.terms import params_on_rank
from ..shape import ModelShape

__all__ = ["layers_on_rank", "moe_block", "expert_gemms", "dispatch_seconds", "params_split", "expert_sync",
           "tokens_on_rank", "expert_flops", "dispatch_bytes", "tp_share"]


def layers_on_rank(shape: ModelShape, config, layers: int) -> int:
    """MoE blocks among the fullest rank's ``layers`` (the last stage's, or the share of the model's)."""
    if config.pp * config.chunks == 1:
        return len(shape.moe_blocks)
    last = range(shape.layers - layers, shape.layers)
    return max(sum(i in shape.moe_blocks for i in last), math.ceil(layers * len(shape.moe_blocks) / shape.layers))


def tokens_on_rank(config, rows: float, seq: int) -> float:
    """T, the tokens a rank routes through an MoE layer in one microbatch of ``rows`` rows: ``rows seq / sp``
    (each sp rank its own part of each row); tp does not divide them (every tp rank routes the same tokens)."""
    return rows * seq / config.sp


_tokens = tokens_on_rank


def expert_flops(shape: ModelShape, config, rows: float, seq: int) -> float:
    """Forward FLOPs of one MoE block's routed experts on one rank for one microbatch: ``2 T k h f (2 or 3)``
    (``E / ep`` experts, ``T k ep / E`` rows each); under 1D tp every tp rank does all of them (repeated tp times
    over the tp group, not split)."""
    matrices = (3 if shape.gated else 2) * shape.hidden * shape.d_expert  # one expert's weights, no bias
    return 2 * tokens_on_rank(config, rows, seq) * shape.top_k * matrices


def dispatch_bytes(shape: ModelShape, config, rows: float, seq: int) -> float:
    """Bytes one rank sends into one dispatch (or combine) all-to-all of one MoE block and microbatch: its
    ``T k`` assignments of ``h`` values each (0 without ep)."""
    if config.ep <= 1:
        return 0.0
    size = 4 if config.precision == "fp32" else 2
    return tokens_on_rank(config, rows, seq) * shape.top_k * shape.hidden * size


def tp_share(config, n_moe: int, layers: int) -> float:
    """The share of a dense block's 1D tp collectives the rank's mean block has when ``n_moe`` of its ``layers``
    are MoE blocks: those keep attention's (half of them), not the MLP's."""
    return 1.0 - 0.5 * n_moe / layers if config.tp > 1 and layers else 1.0


def _whole(hw: Hardware, p: str, m: float, n: float, k: float) -> tuple[float, float, float]:
    """(forward, dX, dW) seconds of a GEMM run whole on the rank (not split by tp)."""
    return hw.gemm_seconds(m, n, k, p), hw.gemm_seconds(m, k, n, p), hw.gemm_seconds(k, n, m, p)


def moe_block(shape: ModelShape, config, rows: float, seq: int, hw: Hardware, dense: BlockCost) -> BlockCost:
    """``dense`` (a dense block's ``BlockCost``) with its MLP (split by tp) replaced by the MoE layer's compute
    (whole on every tp rank: the router, the shared experts, the routed experts on ``T`` tokens)."""
    p, h = config.precision, shape.hidden
    t = _tokens(config, rows, seq)
    width = 2 if shape.gated else 1
    fc1 = gemm(hw, p, config, t, shape.d_ff * width, h, True)
    fc2 = gemm(hw, p, config, t, h, shape.d_ff, False)
    up, down = expert_gemms(shape, config, t, hw)
    router = _whole(hw, p, t, shape.experts, h)
    shared = ((_whole(hw, p, t, shape.shared_ffn * width, h), _whole(hw, p, t, h, shape.shared_ffn))
              if shape.shared_ffn else ())
    size = 4 if p == "fp32" else 2
    permute = hw.stream_seconds(4 * t * shape.top_k * h * size, 4)  # gather, scatter: read + write each
    gemms = (up, down, router) + shared
    f = dense.f - fc1[0] - fc2[0] + sum(g[0] for g in gemms) + permute
    i = dense.i - fc1[1] - fc2[1] + sum(g[1] for g in gemms) + permute
    w = dense.w - fc1[2] - fc2[2] + sum(g[2] for g in gemms)
    # per-op (recompute.op): every second counted matmul and the elementwise ops run again. The router is an odd
    # one (after qkv, proj; or q, k, v, o): kept. The routed experts' grouped GEMMs are not counted matmuls: both
    # run again (the combine's backward needs their outputs), and so does the dispatch. A shared expert's first
    # matmul (its gate, gated) runs again, its next is kept. A dense block's recomputed MLP matmul (up, gated) is
    # not in an MoE block.
    mlp_again = gemm(hw, p, config, t, shape.d_ff, h, True)[0] if shape.gated else 0.0
    shared_again = shared[0][0] / width if shared else 0.0
    op = (dense.op or 0.0) - mlp_again + up[0] + down[0] + permute + shared_again
    # full: the MoE block's forward again; torch's early stop leaves the MoE GPT's shared expert's last GEMM out
    # (a plain module, run last, nothing saved after it; the combine's backward needs the routed experts'
    # outputs, so they run again). Other orders (Qwen2-MoE's gated shared expert) are priced whole.
    tail = shared[1][0] if shared and shape.name == "GPT-MoE" else 0.0
    left_out = plain_left_out(config, hw.stack)
    rc = {"full": f - (tail if left_out else 0.0), "op": op, "selective": dense.rc}.get(recompute_mode(config), 0.0)
    return BlockCost(f=f, i=i, w=w, attn=dense.attn, rc=rc, op=op, tail=tail)


def expert_gemms(shape: ModelShape, config, tokens: float, hw: Hardware) -> tuple[tuple, tuple]:
    """``(up, down)``: (forward, dX, dW) seconds of the rank's ``E / ep`` experts' (gate and) up and down
    projections, each expert on ``tokens k ep / E`` rows (balanced routing), as grouped GEMMs of that size."""
    p, h, local = config.precision, shape.hidden, shape.experts / config.ep
    per = tokens * shape.top_k * config.ep / shape.experts  # rows of one local expert
    fw, f1 = shape.d_expert * (2 if shape.gated else 1), shape.d_expert
    up = (hw.gemm_seconds(per, fw, h, p, local), hw.gemm_seconds(per, h, fw, p, local),
          hw.gemm_seconds(h, fw, per, p, local))
    down = (hw.gemm_seconds(per, h, f1, p, local), hw.gemm_seconds(per, f1, h, p, local),
            hw.gemm_seconds(f1, h, per, p, local))
    return up, down


def dispatch_seconds(shape: ModelShape, config, rows: float, seq: int, hw: Hardware) -> tuple[float, float, tuple]:
    """``(forward, backward, (count forward, backward))``: one MoE block's dispatch and combine all-to-alls on
    one rank for one microbatch (``T k h`` values each), and their transposes backward."""
    if config.ep <= 1:
        return 0.0, 0.0, (0, 0)
    payload = dispatch_bytes(shape, config, rows, seq)
    one = comm.seconds("all_to_all", payload, comm.placement(config, Axis.EP, hw.gpus_per_node), hw)
    counts = comm.seconds("all_to_all", 8 * shape.experts, comm.placement(config, Axis.EP,
                                                                                      hw.gpus_per_node), hw)
    return 2 * one + counts, 2 * one, (3, 2)


def params_split(shape: ModelShape, config, layers: int) -> tuple[float, float]:
    """``(dense, experts)`` parameters the fullest rank holds before ZeRO: its blocks (MoE blocks without
    their routed experts), the head and embeddings as ``cluster.terms.params_on_rank`` counts them (split by
    tp), the MoE blocks' router and shared experts whole on every tp rank, and ``E / ep`` experts of each of
    its MoE blocks (whole on every tp rank)."""
    n_moe = layers_on_rank(shape, config, layers)
    tp = config.tp
    whole = shape.experts * shape.hidden + (shape.mlp_params(shape.shared_ffn) if shape.shared_ffn else 0)
    # params_on_rank counts every block as a dense one over tp: an MoE block's attention and norms stay
    # (split), its dense MLP goes, its router and shared experts come whole
    dense = (params_on_rank(shape, config) - n_moe * (shape.block_params() - shape.moe_dense_params() + whole) / tp
             + n_moe * whole)
    return dense, n_moe * shape.experts / config.ep * shape.expert_params


def expert_sync(shape: ModelShape, config, hw: Hardware, experts: float, window: float, layers: int) -> tuple:
    """``(exposed, total, collectives)`` seconds of the experts' gradient reduction over edp (fp32; ZeRO 1-2 a
    reduce-scatter and the parameters gathered back), hidden behind ``window`` but its last bucket. Under ZeRO-3
    nothing here: each block's expert chunk is gathered and reduce-scattered over edp with the block
    (``cluster.price.price``), as the engine does (``zero/split.py``)."""
    group = comm.placement(config, Axis.EDP, hw.gpus_per_node)
    if group.size <= 1 or experts <= 0 or config.zero == 3:  # ZeRO-3: reduced with each block's chunks (scale)
        return 0.0, 0.0, 0
    op = "all_reduce" if config.zero == 0 else "reduce_scatter"
    reduce = comm.seconds(op, experts * 4, group, hw)
    exposed, total, count = max(reduce / max(1, layers), reduce - window), reduce, 1
    if config.zero in (1, 2):
        size = 4 if config.precision == "fp32" else 2
        gather = comm.seconds("all_gather", experts * size / group.size, group, hw)
        exposed, total, count = exposed + gather, total + gather, 2
    return exposed, total, count

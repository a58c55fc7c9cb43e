"""What a mixture of experts adds to ``planner.scale.price``: the expert GEMMs, the all-to-all, the edp reduction.

For the fullest rank's ``n_moe`` MoE blocks of ``layers`` (``layers_on_rank``), T tokens of a microbatch on the
rank, hidden h, top-k k, E experts over ``ep`` ranks, expert width f (x2 gated), shared width S:

- **compute**: the dense MLP's two GEMMs give way to the router ``(T, E, h)``, the shared experts' MLP and the
  routed experts at their grouped sizes: each of the rank's ``E / ep`` experts gets ``T k ep / E`` rows (balanced
  routing: the ep group's ``T k ep`` rows spread over its ``E`` experts), ``E / ep`` GEMMs
  ``(T k ep / E, f, h)`` and ``(T k ep / E, h, f)`` forward, their dX and dW backward; the dispatch's permutes
  (2 passes over ``T k h``) at HBM speed;
- **comm:ep**: the dispatch and combine all-to-alls of ``T k h`` values forward, the two transposes backward,
  full recomputation replaying the forward two (``colab_kit.expert.layer``), on the ep group as the rank
  order places it (``scale_comm.placement(config, "ep")``: ep is the fastest part of the folded dp x sp block,
  so an ep group of at most ``G / tp`` ranks sits inside a node, NVLink; a larger one crosses nodes, each rank's
  bytes for other nodes on its NIC): nothing hidden (DeepSeek-V3's DualPipe overlaps them; this engine does
  not);
- **comm:dp**: dense gradients over dp as for a dense model; the rank's experts' gradients (fp32) over
  ``edp = dp sp / ep`` ranks (``placement(config, "edp")``: ``ep`` ranks apart), hidden behind the last
  microbatch's backward but its last bucket, and their parameters gathered back under ZeRO 1-2.

Worked example: 64 experts of width 1,408 over ep=8 on one DGX H100 node, 4 rows of 4,096 tokens, top-6,
hidden 2,048 in bf16: each all-to-all carries 16,384 x 6 x 2,048 x 2 B = 403 MB per rank, 7/8 of it to the node's
other GPUs over NVLink (450 GB/s each way at 0.7 of it: 1.1 ms), and forward adds the counts' small one::

    >>> from colab_kit.config import ParallelConfig
    >>> from colab_kit.planner.shape import ModelShape
    >>> from colab_kit.planner.hardware import HARDWARE
    >>> s = ModelShape(layers=28, hidden=2048, heads=16, vocab=102400, seq=4096, ffn=10944, gated=True,
    ...                positions=False, experts=64, top_k=6, d_expert=1408, shared_ffn=2816,
    ...                moe_blocks=tuple(range(1, 28)))
    >>> f, b, n = dispatch_seconds(s, ParallelConfig(dp=8, ep=8, precision="bf16"), 4, 4096, HARDWARE["8xH100-SXM"])
    >>> round(f * 1e3, 1), n                     # counts, dispatch, combine forward; two transposes backward
    (2.3, (3, 2))
"""
from __future__ import annotations

import math

from . import scale_comm
from .hardware import Hardware
from .scale_compute import BlockCost, _gemm
from .scale_parts import params_on_rank
from .shape import ModelShape

__all__ = ["layers_on_rank", "moe_block", "expert_gemms", "dispatch_seconds", "params_split", "expert_sync"]


def layers_on_rank(shape: ModelShape, config, layers: int) -> int:
    """MoE blocks among the fullest rank's ``layers`` (the last stage's, or the share of the model's)."""
    if config.pp * config.chunks == 1:
        return len(shape.moe_blocks)
    last = range(shape.layers - layers, shape.layers)
    return max(sum(i in shape.moe_blocks for i in last), math.ceil(layers * len(shape.moe_blocks) / shape.layers))


def _tokens(config, rows: float, seq: int) -> float:
    return rows * seq / (config.sp if config.sp > 1 else 1)


def moe_block(shape: ModelShape, config, rows: float, seq: int, hw: Hardware, dense: BlockCost) -> BlockCost:
    """``dense`` (a dense block's ``BlockCost``) with its MLP replaced by the MoE layer's compute."""
    p, h = config.precision, shape.hidden
    t = _tokens(config, rows, seq)
    width = 2 if shape.gated else 1
    fc1 = _gemm(hw, p, config, t, shape.d_ff * width, h, True)
    fc2 = _gemm(hw, p, config, t, h, shape.d_ff, False)
    up, down = expert_gemms(shape, config, t, hw)
    router = _gemm(hw, p, config, t, shape.experts, h, True)
    shared = ((_gemm(hw, p, config, t, shape.shared_ffn * width, h, True),
               _gemm(hw, p, config, t, h, shape.shared_ffn, False)) if shape.shared_ffn else ())
    size = 4 if p == "fp32" else 2
    permute = hw.stream_seconds(4 * t * shape.top_k * h * size, 4)  # gather, scatter: read + write each
    gemms = (up, down, router) + shared
    f = dense.f - fc1[0] - fc2[0] + sum(g[0] for g in gemms) + permute
    i = dense.i - fc1[1] - fc2[1] + sum(g[1] for g in gemms) + permute
    w = dense.w - fc1[2] - fc2[2] + sum(g[2] for g in gemms)
    rc = {0.0: 0.0, dense.f: f}.get(dense.rc, dense.rc)  # full recomputation repeats the MoE forward
    return BlockCost(f=f, i=i, w=w, attn=dense.attn, rc=rc)


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
    size = 4 if config.precision == "fp32" else 2
    payload = _tokens(config, rows, seq) * shape.top_k * shape.hidden * size
    one = scale_comm.seconds("all_to_all", payload, scale_comm.placement(config, "ep", hw.gpus_per_node), hw)
    counts = scale_comm.seconds("all_to_all", 8 * shape.experts, scale_comm.placement(config, "ep",
                                                                                      hw.gpus_per_node), hw)
    return 2 * one + counts, 2 * one, (3, 2)


def params_split(shape: ModelShape, config, layers: int) -> tuple[float, float]:
    """``(dense, experts)`` parameters the fullest rank holds before ZeRO: its blocks (MoE blocks without
    their routed experts), the head and embeddings as ``scale_parts.params_on_rank`` counts them, and
    ``E / ep`` experts of each of its MoE blocks."""
    n_moe = layers_on_rank(shape, config, layers)
    dense = params_on_rank(shape, config) - n_moe * (shape.block_params() - shape.moe_dense_params())
    return dense, n_moe * shape.experts / config.ep * shape.expert_params


def expert_sync(shape: ModelShape, config, hw: Hardware, experts: float, window: float, layers: int) -> tuple:
    """``(exposed, total, collectives)`` seconds of the experts' gradient reduction over edp (fp32; ZeRO 1-2 a
    reduce-scatter and the parameters gathered back), hidden behind ``window`` but its last bucket."""
    group = scale_comm.placement(config, "edp", hw.gpus_per_node)
    if group.size <= 1 or experts <= 0:
        return 0.0, 0.0, 0
    op = "all_reduce" if config.zero == 0 else "reduce_scatter"
    reduce = scale_comm.seconds(op, experts * 4, group, hw)
    exposed, total, count = max(reduce / max(1, layers), reduce - window), reduce, 1
    if config.zero in (1, 2):
        size = 4 if config.precision == "fp32" else 2
        gather = scale_comm.seconds("all_gather", experts * size / group.size, group, hw)
        exposed, total, count = exposed + gather, total + gather, 2
    return exposed, total, count

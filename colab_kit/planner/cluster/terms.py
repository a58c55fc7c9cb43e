"""The per-axis pieces ``planner.cluster.price.price`` adds up: tensor and sequence collectives of one block, the
parameters a rank holds, the optimizer's update.

``tensor_comm`` per block and microbatch, for T tokens, hidden h, ``size`` bytes a value (2 in fp16 / bf16):

=========================  ============================================================================
1D (Megatron)              2 all-reduces of (T, h) forward, 2 backward
1D + split_gather          2 all-gathers (T/tp, h) + 2 reduce-scatters (T, h) forward, the same backward
2D (SUMMA, q x q)          per GEMM (M, N, K): q broadcasts of an X block (M/q, K/q) in the grid row and q of
                           a W block (K/q, N/q) in the grid column forward; twice that backward
2.5D (depth d)             2D's on blocks (M/(d q), K/q) and (K/q, N/q); backward also sums the weight
                           gradients over the depth (an all-reduce of (K/q, N/q))
3D (q x q x q)             per GEMM: all-gather X (M K / q^3) and W (K N / q^3), reduce-scatter Y (M N / q^2);
                           twice that backward
=========================  ============================================================================

Worked example: 1D tp=8 on one DGX A100 node, 8 rows x 2048 tokens x 6144 hidden in fp16, each all-reduce
201 MB (wire 352 MB at 0.7 x 300 GB/s, about 1.7 ms)::

    >>> from colab_kit.config import ParallelConfig
    >>> from colab_kit.planner.shape import ModelShape
    >>> from colab_kit.planner.cluster.hardware import HARDWARE
    >>> f, b, n = tensor_comm(ModelShape(40, 6144, 48, 51200, 2048), ParallelConfig(tp=8, precision="fp16"),
    ...                       8, 2048, HARDWARE["8xA100-80GB"])
    >>> round(f * 1e3, 1), n
    (3.4, (2, 2))
"""
from __future__ import annotations

from . import comm
from ...config import Axis
from .hardware import Hardware
from .compute import block, head
from ..shape import ModelShape

__all__ = ["BLOCK_FIELDS", "HOST_BYTES_PER_S", "optimizer_seconds", "params_on_rank", "per_block", "seq_comm",
           "tensor_comm"]

HOST_BYTES_PER_S = 10e9
"""Assumption: host memory bandwidth one GPU's share of the CPU cores streams through a CPU Adam (offload)."""

_UPDATE_BYTES = {"adamw": 30, "adam": 30, "sgd-momentum": 20, "sgd-nomomentum": 12}
"""HBM bytes per parameter of an update with fp32 master weights: gradient 4, master 4 + 4, each state 4 + 4,
the 16-bit copy 2 (fp32 training: no copy, 2 fewer)."""


def _tokens(config, rows: float, seq: int) -> float:
    split = config.sp if config.sp > 1 and config.sp_mode in ("ring", "ulysses") else 1
    return rows * seq / split


def _gemms(shape: ModelShape, tokens: float) -> list[tuple[float, float, float]]:
    h, ff = shape.hidden, shape.d_ff * (2 if shape.gated else 1)
    return [(tokens, shape.qkv_out, h), (tokens, h, h), (tokens, ff, h), (tokens, h, shape.d_ff)]


def tensor_comm(shape: ModelShape, config, rows: float, seq: int, hw: Hardware) -> tuple[float, float, tuple]:
    """``(forward seconds, backward seconds, (collectives forward, backward))`` of the tensor mode's
    collectives in one block for one microbatch on one rank (see the module docstring)."""
    if config.tp == 1:
        return 0.0, 0.0, (0, 0)
    size = 4 if config.precision == "fp32" else 2
    tokens, g, q = _tokens(config, rows, seq), hw.gpus_per_node, config.tp_q
    x = tokens * shape.hidden * size
    if config.tp_mode == "1d":
        group = comm.placement(config, Axis.TP, g)
        if config.sp_mode == "split_gather":
            one = (comm.seconds("all_gather", x / config.tp, group, hw)
                   + comm.seconds("reduce_scatter", x, group, hw))
            return 2 * one, 2 * one, (4, 4)
        one = comm.seconds("all_reduce", x, group, hw)
        return 2 * one, 2 * one, (2, 2)
    if config.tp_mode in ("2d", "2.5d"):
        row, col = comm.placement(config, Axis.TP_COL, g), comm.placement(config, Axis.TP_ROW, g)
        d = config.tp_depth if config.tp_mode == "2.5d" else 1
        fwd = sum(q * (comm.seconds("broadcast", m / (d * q) * k / q * size, row, hw)
                       + comm.seconds("broadcast", k / q * n / q * size, col, hw))
                  for m, n, k in _gemms(shape, tokens))
        n_f = 4 * 2 * q
        bwd, n_b = 2 * fwd, 2 * n_f
        if d > 1:
            dep = comm.placement(config, Axis.TP_DEP, g)
            bwd += sum(comm.seconds("all_reduce", k / q * n / q * size, dep, hw)
                       for m, n, k in _gemms(shape, tokens))
            n_b += 4
        return fwd, bwd, (n_f, n_b)
    axes = [comm.placement(config, a, g) for a in (Axis.TP_IN, Axis.TP_WT, Axis.TP_OUT)]
    fwd = sum(comm.seconds("all_gather", m * k / q ** 3 * size, axes[0], hw)
              + comm.seconds("all_gather", k * n / q ** 3 * size, axes[1], hw)
              + comm.seconds("reduce_scatter", m * n / q ** 2 * size, axes[2], hw)
              for m, n, k in _gemms(shape, tokens))
    return fwd, 2 * fwd, (12, 24)


def seq_comm(shape: ModelShape, config, rows: float, seq: int, hw: Hardware, attn: float) -> tuple:
    """``(forward, backward, forward exposed, backward exposed, (count forward, backward))`` seconds of the
    sequence mode's collectives in one block: ring attention passes K and V blocks ``sp - 1`` times (and
    their gradients back as well backward), hidden behind the attention core (``attn`` seconds forward,
    twice backward); Ulysses' all-to-alls of q, k, v and the output, none hidden. split_gather's are
    the tensor mode's (``tensor_comm``)."""
    sp = config.sp
    if sp == 1 or config.sp_mode == "split_gather":
        return 0.0, 0.0, 0.0, 0.0, (0, 0)
    size = 4 if config.precision == "fp32" else 2
    tokens = _tokens(config, rows, seq)
    group = comm.placement(config, Axis.SP, hw.gpus_per_node)
    kv = 2 * shape.n_kv * shape.head_dim / config.tp
    if config.sp_mode == "ring":
        step = comm.seconds("send", tokens * kv * size, group, hw)
        f, b = (sp - 1) * step, 2 * (sp - 1) * step
        return f, b, max(0.0, f - attn), max(0.0, b - 2 * attn), (sp - 1, 2 * (sp - 1))
    widths = (shape.hidden / config.tp, kv, shape.hidden / config.tp)  # q, k and v together, the output
    f = sum(comm.seconds("all_to_all", tokens * w * size, group, hw) for w in widths)
    return f, f, f, f, (4, 4)


def params_on_rank(shape: ModelShape, config) -> float:
    """Parameters the fullest rank holds before ZeRO: the last stage's blocks, the head (and the token
    table too with one stage), cut by the tensor mode (2.5D: replicated over its depth)."""
    split = config.tp_q ** 2 if config.tp_mode == "2.5d" else config.tp
    per_rank = -(-shape.layers // (config.pp * config.chunks)) * config.chunks
    out = per_rank * shape.block_params() + shape.vocab * shape.hidden + 2 * shape.hidden
    if config.pp == 1 and not shape.tied:
        out += shape.vocab * shape.hidden + (shape.seq * shape.hidden if shape.positions else 0)
    return out / split


def optimizer_seconds(rank_params: float, config, hw: Hardware, optimizer: str, group: int,
                      host_share: float = 1.0) -> float:
    """The update of the rank's shard (ZeRO >= 1: ``1 / group`` of its parameters) streamed through HBM, or
    under offload the shard's gradients down and parameters up over PCIe and the update on the host; under
    ``offload="auto"`` that for the ``host_share`` of the shard the placement put on the host, the rest on the
    device (``host_share`` 0: as without offload)."""
    shard = rank_params / (group if config.zero >= 1 else 1)
    per = _UPDATE_BYTES.get(optimizer, 30) - (2 if config.precision == "fp32" else 0)
    if config.offload in ("cpu", "auto") and config.zero >= 1:
        share = 1.0 if config.offload == "cpu" else host_share
        size = 4 if config.precision == "fp32" else 2
        pcie = (4 + size) / hw.pcie_bytes_per_s if config.zero < 3 else 0.0  # ZeRO-3: zero3_transfers, per gather
        host = share * shard * (pcie + per / HOST_BYTES_PER_S)
        return host + (hw.stream_seconds((1 - share) * shard * per, 8) if share < 1 else 0.0)
    return hw.stream_seconds(shard * per, 8)


def zero3_transfers(shape: ModelShape, config, rank_params: float, experts: float, group: int, edp: int,
                    host_share: float = 1.0) -> dict:
    """Bytes a ZeRO-3 rank with offload moves over PCIe in a step, as the engine's placement counts them
    (``placement.last_transfers``): each host chunk's shard staged to the device for each gather, forward and
    backward in every microbatch (the tail, final norm and untied head, once), and each microbatch's reduced
    fp32 piece back; ``host_share`` of it under ``offload="auto"``. ``rank_params`` over ``group`` (dp x sp: the
    ranks the engine's ZeRO shards over), an MoE's ``experts`` over ``edp``; under tp ``rank_params`` as
    ``params_on_rank`` counts them (the norms and row biases every tp rank holds whole, split too: 2.4% under
    at d 32, nothing at scale). Worked example, a 4-block GPT of d 32 over dp=2 in fp32 (55,488
    parameters, the tail 2,112): ``(2 x 55,488 - 2,112) / 2 x 4`` B up, ``55,488 / 2 x 4`` B back::

        >>> from colab_kit.config import ParallelConfig
        >>> s = ModelShape(layers=4, hidden=32, heads=4, vocab=64, seq=16)
        >>> zero3_transfers(s, ParallelConfig(dp=2, zero=3, offload="cpu"), 55488, 0, 2, 1)
        {'to_device': 217728.0, 'to_host': 110976.0}
    """
    if config.zero != 3 or config.offload not in ("cpu", "auto"):
        return {"to_device": 0.0, "to_host": 0.0}
    share = 1.0 if config.offload == "cpu" else host_share
    size, m = (4 if config.precision == "fp32" else 2), config.microbatches
    split = config.tp_q ** 2 if config.tp_mode == "2.5d" else config.tp
    tail = ((shape.hidden if shape.gated else 2 * shape.hidden) + (0 if shape.tied else shape.vocab * shape.hidden)
            / split)
    up = (2 * rank_params - tail) / group + 2 * experts / edp
    down = rank_params / group + experts / edp
    return {"to_device": share * m * size * up, "to_host": share * m * 4 * down}


BLOCK_FIELDS = ("precision", "tp", "tp_mode", "tp_depth", "sp", "sp_mode")
"""The config fields that a block's and the head's compute (``compute.block``, ``head``) and the block's
tensor and sequence collectives (``tensor_comm``, ``seq_comm``: their groups lie inside a tp x sp block of the
rank order) read. A field they start to read must be added here: it is ``per_block``'s key."""

_BLOCKS: dict = {}


def per_block(shape: ModelShape, config, rows: float, seq: int, hw: Hardware) -> tuple:
    """``(block, head, tensor_comm, seq_comm)`` of one microbatch of ``rows`` sequences on one rank, computed once
    per shape, preset, rows, seq and ``BLOCK_FIELDS``: the configs of every dp, pipeline depth, schedule, chunk
    count, ZeRO stage and recomputation with the same microbatch share them (the 175B plan of 1,536 GPUs prices
    12,000 configs that hold 1,700 different blocks). Emptied at 16,384 entries.

        >>> from colab_kit.config import ParallelConfig
        >>> from colab_kit.planner.cluster.hardware import HARDWARE
        >>> s, a100 = ModelShape(40, 6144, 48, 51200, 2048), HARDWARE["8xA100-80GB"]
        >>> one = ParallelConfig(dp=4, tp=8, pp=2, sp=2, microbatches=4, precision="fp16")
        >>> other = one.replace(dp=2, pp=4, schedule="interleaved", chunks=2, zero=1, recompute="full")
        >>> per_block(s, one, 4, 2048, a100) is per_block(s, other, 4, 2048, a100)
        True
        >>> b = block(s, other, 4, 2048, a100)
        >>> per_block(s, one, 4, 2048, a100) == (b, head(s, other, 4, 2048, a100),
        ...     tensor_comm(s, other, 4, 2048, a100), seq_comm(s, other, 4, 2048, a100, b.attn))
        True
    """
    key = (shape, hw, rows, seq) + tuple(getattr(config, f) for f in BLOCK_FIELDS)
    got = _BLOCKS.get(key)
    if got is None:
        if len(_BLOCKS) >= 1 << 14:
            _BLOCKS.clear()
        dense = block(shape, config, rows, seq, hw)
        got = _BLOCKS[key] = (dense, head(shape, config, rows, seq, hw), tensor_comm(shape, config, rows, seq, hw),
                              seq_comm(shape, config, rows, seq, hw, dense.attn))
    return got

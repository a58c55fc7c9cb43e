"""``price``: one training step of a parallel config on a GPU cluster, from the model's shape and a node preset.

The at-scale cost model (the local one, ``planner.local.step``, is fitted on this machine's CPU ranks instead).
For the fullest rank (the last pipeline stage, which also runs the head and the loss)::

    step = compute + bubble + comm:tp + comm:sp + comm:pp + comm:dp (exposed) + optimizer + host

- ``compute``: m microbatches x the rank's blocks (``compute.block``: forward, backward, and what the
  recompute mode repeats) + the head; at the preset's matmul curve and HBM bandwidth;
- ``bubble``: the schedule's idle time, closed forms checked against the engine's own plan
  (``pipeline.build_plan`` + ``simulate``, tests/unit/test_scale_cost.py) with each rank's per-microbatch
  F, I (input gradient, with its recompute) and W (weight gradient), exposed communication included:
  gpipe / 1f1b ``(p-1)(F+I+W)``; interleaved ``(p-1)(F+I+W)/v``; zb-h1 ``(p-1)(F+I-W)``; zb-v ``(p-1)(F+I-W)/2``;
- ``comm:tp``: Megatron 1D, two all-reduces of (T, h) forward and two backward per block and microbatch, two
  more replayed by full recomputation, none hidden; split_gather the same bytes as all-gathers and
  reduce-scatters; 2D / 2.5D / 3D their broadcasts, all-gathers and reduce-scatters per GEMM
  (``terms.tensor_comm``);
- ``comm:sp``: ring K/V rotations hidden behind the attention core they feed (exposed = what does not fit);
  Ulysses' four all-to-alls forward and backward, exposed;
- ``comm:pp``: an activation forward and a gradient back per microbatch and chunk, ``m v + p - 1`` of each;
- ``comm:dp``: gradients reduced in fp32 over dp x sp (the sp ranks' sum of their token shares in the same
  collective, the group ZeRO shards over: colab_kit's engine, Megatron-Core's distributed optimizer with
  context parallelism, torchtitan's FSDP over ``dp_shard x cp``; an MoE's experts are dense parameters at
  ep 1): ZeRO 0 an all-reduce, hidden
  behind the last microbatch's backward except its last bucket (a block's share); ZeRO 1-2 a reduce-scatter
  so hidden and an all-gather of the parameters after the update; ZeRO-3 each block's parameters gathered
  forward and backward and its gradients reduce-scattered, per microbatch, each hidden behind that block's
  compute at most;
- ``optimizer``: the update streamed through HBM (AdamW: about 30 bytes a parameter of the rank's shard);
  offload="cpu": the shard's gradients down and parameters up over PCIe and the update on the host;
- ``offload`` (ZeRO-3 with offload): each host chunk's shard staged up per gather and its reduced piece back
  per microbatch (``terms.zero3_transfers``, the engine's count), on side streams under compute: what it does
  not cover;
- ``host``: the part of the host's dispatch (operators a step x seconds an operator, ``host``) that the rank's
  own GPU work does not cover (the bubble hides none of it: the host waits through it too): a small model's
  step is the host's.

Worked example, Table 1's 145B row (tp 8, pp 8, dp 24, interleaved x 2 chunks, 48 microbatches of 2,
full recomputation, fp16) on DGX A100 nodes; published iteration 24.8 s::

    >>> from colab_kit.planner.published import as_run, table1
    >>> shape, config, batch = as_run(table1()[6])
    >>> p = price(shape, config, batch, "8xA100-80GB")
    >>> 0.85 < p.step_seconds / 24.82 < 1.15
    True
    >>> sorted(p.breakdown)
    ['bubble', 'comm:dp', 'comm:pp', 'comm:sp', 'comm:tp', 'compute', 'host', 'optimizer']
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from . import comm, host
from ...config import Axis
from ..moe import price as moe_price
from ..moe.shape import tp_layer_params
from .hardware import Hardware, preset
from .compute import BlockCost, attention_note, recompute_mode, with_recompute
from .stack import replayed_by_full
from .terms import optimizer_seconds, params_on_rank, per_block, zero3_transfers
from ..shape import ModelShape

__all__ = ["Priced", "bubble", "compute_floor", "price", "recompute_mode"]

AXES = (Axis.TP, Axis.SP, Axis.PP, Axis.DP)


@dataclass(frozen=True)
class Priced:
    """One step of one config: ``step_seconds`` = the sum of ``breakdown`` (compute, exposed comm per axis,
    bubble, optimizer, the host's floor beyond them); ``comm_total`` per axis before overlap; ``collectives`` per
    axis per step on one rank; ``assumptions``: every figure taken from the preset, with its source, and the
    model's choices; ``per_microbatch``: the rank's F, I, W seconds of one microbatch (exposed comm included)."""
    step_seconds: float
    breakdown: dict
    comm_total: dict
    collectives: dict
    assumptions: tuple
    per_microbatch: dict = field(default_factory=dict)
    transfers: dict = field(default_factory=dict)
    """ZeRO-3 with offload: bytes over PCIe a step each way (``terms.zero3_transfers``)."""


def price(shape: ModelShape, config, batch: int, hw: Hardware | str, *, seq: int | None = None,
          optimizer: str = "adamw", host_share: float | None = None) -> Priced:
    """Seconds of one training step of ``config`` (any config ``ParallelConfig`` accepts) training ``shape`` on
    ``batch`` global rows of ``seq`` tokens (the shape's when None) on nodes of preset ``hw`` (a name of
    ``hardware.HARDWARE`` or a ``Hardware``). ``optimizer``: adamw, adam, sgd-momentum, sgd-nomomentum.
    ``host_share``: under ``offload="auto"`` (and needed there), the share of the model states placed on the
    host (``memory.formulas.host_share``). Results are cached: the planner prices thousands of configs."""
    if config.offload == "auto" and host_share is None:
        raise ValueError("price of offload='auto' needs host_share, the share of the model states its placement "
                         "puts on the host (memory.formulas.host_share of the estimate's memory; ck.estimate "
                         "passes it)")
    return _price(shape, config, int(batch), preset(hw), int(seq or shape.seq), str(optimizer).lower(),
                  float(host_share) if config.offload == "auto" and host_share is not None else 1.0)


def bubble(schedule: str, pp: int, m: int, chunks: int, f: float, i: float, w: float) -> float:
    """Idle seconds of a pipeline rank in ``schedule`` beyond its own ``m`` microbatches of work, each
    microbatch costing the whole rank ``f`` forward, ``i`` input-gradient and ``w`` weight-gradient seconds
    (``m`` and ``chunks`` only shape the schedule: the closed forms of the module docstring)."""
    if pp <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) * (f + i + w)
    if schedule == "interleaved":
        return (pp - 1) * (f + i + w) / chunks
    if schedule == "zb-h1":
        return (pp - 1) * max(f, f + i - w)
    if schedule == "zb-v":
        return (pp - 1) * max(f, f + i - w) / 2
    raise ValueError(f"unknown schedule {schedule!r}")


@functools.lru_cache(maxsize=1 << 16)
def _price(shape: ModelShape, config, batch: int, hw: Hardware, seq: int, optimizer: str,
           host_share: float = 1.0) -> Priced:
    m, p, v = config.microbatches, config.pp, config.chunks
    rows = batch / (config.dp * m)
    mode = recompute_mode(config)
    dense, hd, (tp_f, tp_b, tp_n), (sp_f, sp_b, sp_exp_f, sp_exp_b, sp_n) = per_block(shape, config, rows, seq, hw)
    left_out, tp_replayed = replayed_by_full(config, hw.stack)  # torch's early stop, by how the layers are written
    blk = with_recompute(dense, mode, left_out)
    layers = math.ceil(shape.layers / (p * v)) * v  # the fullest rank's blocks
    comm_total = dict.fromkeys(AXES, 0.0)
    count = dict.fromkeys(AXES, 0)
    ep_f = ep_b = ep_rc = 0.0  # a mixture of experts: its blocks, the all-to-alls (planner.moe.price)
    n_moe = moe_price.layers_on_rank(shape, config, layers) if shape.experts else 0
    if n_moe:
        blk = _mix(blk, moe_price.moe_block(shape, config, rows, seq, hw, blk), n_moe / layers)
        a_f, a_b, ep_n = moe_price.dispatch_seconds(shape, config, rows, seq, hw)
        ep_f, ep_b = a_f * n_moe / layers, a_b * n_moe / layers
        # full and per-op recomputation replay the forward's all-to-alls (c10d's in-place ops: nothing to keep)
        replayed = mode in ("full", "op")
        ep_rc = ep_f if replayed else 0.0
        count[Axis.EP] = m * n_moe * (ep_n[0] * (2 if replayed else 1) + ep_n[1])
    # tensor and sequence parallel collectives of one block and microbatch: never hidden (tp), or behind
    # the attention core they feed (sp ring)
    share = moe_price.tp_share(config, n_moe, layers) if n_moe else 1.0
    if n_moe:  # an MoE block runs whole on every tp rank: attention's all-reduces only (moe_price.tp_share)
        tp_f, tp_b = tp_f * share, tp_b * share
    if hw.stack.tp_overlap and config.tp > 1 and config.tp_mode == "1d":  # chunks under the GEMMs they feed
        tp_f, tp_b = _under(tp_f, dense.gemms[0], config.tp), _under(tp_b, dense.gemms[1], config.tp)
    # full replays the forward's tp collectives (with torch's early stop all but the last: 1D the attention's,
    # split_gather three of four: stack.replayed_by_full); per-op ("op") the attention's, in a dense block and an
    # MoE block alike: half a dense block's forward ones (colab_kit's collectives are in-place ops, recomputed,
    # not saved), and, as full, the sequence mode's
    attention_only = mode == "op" or (mode == "full" and tp_replayed == 0.5)
    tp_rc = (tp_f / share / 2 if attention_only else tp_f * tp_replayed if mode == "full" else 0.0)
    sp_rc, sp_exp_rc = (sp_f, sp_exp_f) if mode in ("full", "op") else (0.0, 0.0)
    # ZeRO-3: each block's parameters gathered forward and backward, gradients reduce-scattered (fp32)
    z3_f = z3_b = z3_exp_f = z3_exp_b = 0.0
    grads = comm.placement(config, Axis.DP_SP, hw.gpus_per_node)  # the sp ranks' sum joins the dp reduction
    size = 4 if config.precision == "fp32" else 2
    block_params, block_experts = shape.block_params() / _tp_param_split(config), 0.0
    if n_moe:  # a block's dense parameters over the gradients' group; its E / ep routed experts a chunk over edp
        parts = [tp_layer_params(shape, i, config.tp) for i in range(shape.layers)]
        block_params = sum(d for d, _ in parts) / shape.layers
        block_experts = sum(e for _, e in parts) / shape.layers / config.ep
        if config.ep == 1:  # no expert parallelism: the experts are dense parameters (zero/apply.py), one chunk
            block_params, block_experts = block_params + block_experts, 0.0
    if config.zero == 3 and grads.size > 1:
        edp = comm.placement(config, Axis.EDP, hw.gpus_per_node) if n_moe else grads
        gather = (comm.seconds("all_gather", block_params * size / grads.size, grads, hw)
                  + comm.seconds("all_gather", block_experts * size / edp.size, edp, hw))
        scatter = (comm.seconds("reduce_scatter", block_params * 4, grads, hw)
                   + comm.seconds("reduce_scatter", block_experts * 4, edp, hw))
        pieces = 1
        if hw.stack.zero3_gather == "tensor":  # DeepSpeed 2021: a collective per tensor, each after a device sync
            pieces = block_tensors(shape)
            gather += (pieces - 1) * comm.latency("all_gather", grads, hw)
            scatter += (pieces - 1) * comm.latency("reduce_scatter", grads, hw)
        z3_f, z3_b = gather, gather + scatter
        if hw.stack.zero3_gather == "tensor":  # synchronous: nothing hides behind compute
            z3_exp_f, z3_exp_b = z3_f, z3_b
        else:
            z3_exp_f = max(0.0, z3_f - blk.f)
            z3_exp_b = max(0.0, z3_b - (blk.i + blk.w + blk.rc))
        count[Axis.DP] += m * layers * 3 * pieces + (m * n_moe * 3 if block_experts and edp.size > 1 else 0)
    f_mb = layers * (blk.f + tp_f + sp_exp_f + z3_exp_f + ep_f)
    i_mb = layers * (blk.i + blk.rc + tp_b + tp_rc + sp_exp_b + sp_exp_rc + z3_exp_b + ep_b + ep_rc)
    w_mb = layers * blk.w
    compute = m * (layers * (blk.f + blk.i + blk.w + blk.rc) + hd.f + hd.i + hd.w)
    exposed_tp = m * layers * (tp_f + tp_b + tp_rc)
    exposed_sp = m * layers * (sp_exp_f + sp_exp_b + sp_exp_rc)
    comm_total[Axis.TP] = exposed_tp
    comm_total[Axis.SP] = m * layers * (sp_f + sp_b + sp_rc)
    replay = 2 if mode in ("full", "op") else 1  # the forward's sequence collectives again
    forward_tp = (tp_n[0] + tp_n[0] // 2 if attention_only else tp_n[0] + round(tp_n[0] * tp_replayed)
                  if mode == "full" else tp_n[0])
    count[Axis.TP] += m * layers * (forward_tp + tp_n[1])
    if n_moe and config.tp > 1:  # an MoE block has no MLP all-reduce: fc2's forward one (replayed by a whole
        # forward only) and fc1's backward one
        whole = mode == "full" and tp_replayed == 1.0
        count[Axis.TP] -= m * n_moe * ((tp_n[0] // 2) * (2 if whole else 1) + tp_n[1] // 2)
    count[Axis.SP] += m * layers * (sp_n[0] * replay + sp_n[1])
    # pipeline: p2p of each microbatch and chunk, the schedule's bubble on the other stages' work
    comm_pp = 0.0
    if p > 1:
        tokens = rows * seq / (config.sp if config.sp > 1 else 1)
        act = tokens * shape.hidden * size / (config.tp if config.sp_mode == "split_gather" else 1)
        send = comm.seconds("send", act, comm.placement(config, Axis.PP, hw.gpus_per_node), hw)
        comm_pp = 2 * send * (m * v + p - 1)
        count[Axis.PP] += 2 * (m * v + p - 1)
    comm_total[Axis.PP] = comm_pp
    idle = bubble(config.schedule, p, m, v, f_mb, i_mb, w_mb)
    # data parallel: gradients (fp32) over dp x sp, parameters gathered back under ZeRO 1-2
    rank_params = params_on_rank(shape, config)
    experts = 0.0
    if n_moe:
        rank_params, experts = moe_price.params_split(shape, config, layers)
        if config.ep == 1:  # reduced over dp x sp and updated with the dense ones (zero/apply.py)
            rank_params, experts = rank_params + experts, 0.0
    exposed_dp = m * layers * (z3_exp_f + z3_exp_b)
    comm_dp = m * layers * (z3_f + z3_b)
    if grads.size > 1 and config.zero < 3:
        op = "all_reduce" if config.zero == 0 else "reduce_scatter"
        reduce = comm.seconds(op, rank_params * 4, grads, hw)
        last = reduce / max(1, layers)
        window = layers * (blk.i + blk.w + blk.rc)  # the last microbatch's backward
        exposed_dp += max(last, reduce - window)
        comm_dp += reduce
        count[Axis.DP] += 1 + layers
        if config.zero in (1, 2):
            regather = comm.seconds("all_gather", rank_params * size / grads.size, grads, hw)
            if hw.stack.param_gather == "overlapped":  # bucket by bucket under the next step's first forward
                exposed_dp += max(regather / max(1, layers), regather - layers * blk.f)
            else:
                exposed_dp += regather
            comm_dp += regather
            count[Axis.DP] += 1
    opt = optimizer_seconds(rank_params, config, hw, optimizer, grads.size, host_share)
    notes = _assumptions(hw, config.precision) + (hw.stack.note(),)
    if n_moe:
        edp = config.dp * config.sp // config.ep
        e_exp, e_tot, e_n = moe_price.expert_sync(shape, config, hw, experts, layers * (blk.i + blk.w + blk.rc),
                                                  layers)
        exposed_dp, comm_dp, count[Axis.DP] = exposed_dp + e_exp, comm_dp + e_tot, count[Axis.DP] + e_n
        opt += optimizer_seconds(experts, config, hw, optimizer, edp, host_share) if experts else 0.0
        comm_total[Axis.EP] = m * layers * (ep_f + ep_b + ep_rc)
        notes = notes + _moe_notes(config)
    comm_total[Axis.DP] = comm_dp
    breakdown = {"compute": compute, "bubble": idle, "comm:tp": exposed_tp, "comm:sp": exposed_sp,
                 "comm:pp": comm_pp, "comm:dp": exposed_dp, "optimizer": opt}
    if n_moe:
        breakdown["comm:ep"] = comm_total[Axis.EP]
    moved = zero3_transfers(shape, config, rank_params, experts, config.zero_ranks,  # dp x sp; experts over edp
                            config.dp * config.sp // config.ep if n_moe else 1, host_share)
    if moved["to_device"]:  # on two side streams, one each way, a unit ahead: what compute does not cover
        breakdown["offload"] = max(0.0, max(moved.values()) / hw.pcie_bytes_per_s - compute)
    # the host dispatches while the GPU works, not through the bubble (it waits on the same receives)
    floor = host.host_seconds(shape, config, layers, hw, mode, n_moe if shape.experts else None)
    breakdown["host"] = max(0.0, floor - sum(breakdown.values()) + idle)
    return Priced(step_seconds=sum(breakdown.values()), breakdown=breakdown, comm_total=comm_total,
                  collectives=count, assumptions=notes,
                  per_microbatch={"F": f_mb, "I": i_mb, "W": w_mb}, transfers=moved if moved["to_device"] else {})


def compute_floor(shape: ModelShape, config, batch: int, dp: int, microbatches: int, pp: int, hw: Hardware | str,
                  seq: int | None = None) -> float:
    """A floor under what ``search`` orders configs by (``step_seconds`` less the optimizer and comm:dp) for every
    config of a dense ``shape`` with ``config``'s ``terms.BLOCK_FIELDS``, ``dp``, ``pp`` and
    ``microbatches``, whatever its schedule, chunks, ZeRO stage or recomputation: ``_price``'s compute and exposed
    tp and sp traffic at the fewest blocks a rank of ``pp`` stages holds, ``ceil(layers / pp)``, without
    recomputation; the bubble and the pipeline's sends left out. The same floating-point sums as ``_price``'s,
    each term no larger. A mixture of experts mixes cheaper blocks in: -inf. The example: 8 blocks a rank either
    way, the floor leaving out what full recomputation repeats and the bubble::

        >>> from colab_kit.config import ParallelConfig
        >>> from colab_kit.planner.cluster.hardware import HARDWARE
        >>> s, a100 = ModelShape(96, 12288, 96, 51200, 2048), HARDWARE["8xA100-80GB"]
        >>> c = ParallelConfig(dp=32, tp=4, pp=12, microbatches=48, schedule="interleaved", chunks=2, zero=1,
        ...                    recompute="full", sp_mode="split_gather", precision="fp16")
        >>> floor = compute_floor(s, c, 1536, 32, 48, 12, a100)
        >>> p = price(s, c, 1536, a100)
        >>> floor <= p.step_seconds - p.breakdown["optimizer"] - p.breakdown["comm:dp"]
        True
        >>> floor < p.breakdown["compute"] + p.breakdown["comm:tp"]   # full recomputation's forward left out
        True
    """
    if shape.experts:
        return -math.inf
    m, layers = microbatches, -(-shape.layers // pp)
    dense, hd, (tp_f, tp_b, _), (_, _, sp_exp_f, sp_exp_b, _) = per_block(shape, config, int(batch) / (dp * m),
                                                                          int(seq or shape.seq), preset(hw))
    compute = m * (layers * (dense.f + dense.i + dense.w) + hd.f + hd.i + hd.w)
    return compute + m * layers * (tp_f + tp_b) + m * layers * (sp_exp_f + sp_exp_b)


def _under(seconds: float, gemms: float, chunks: int) -> float:
    """Exposed seconds of tp communication cut into ``chunks`` pieces run under ``gemms`` seconds of the GEMMs
    it feeds (``Stack.tp_overlap``): the first piece, or what the GEMMs cannot cover."""
    return max(seconds / chunks, seconds - gemms)


def block_tensors(shape: ModelShape) -> int:
    """Parameter tensors of one block: a GPT's 12 (two LayerNorms, qkv, proj, fc1, fc2, each a weight and a
    bias), a gated block's 9 (two norms, q, k, v, o, gate, up, down); what DeepSpeed 2021 gathers one by one."""
    return 9 if shape.gated else 12


def _mix(dense: BlockCost, moe: BlockCost, share: float) -> BlockCost:
    """The mean block of a rank whose ``share`` of blocks are MoE blocks (costs add up linearly)."""
    def mean(a, b):
        return (1 - share) * a + share * b
    return BlockCost(mean(dense.f, moe.f), mean(dense.i, moe.i), mean(dense.w, moe.w), dense.attn,
                     mean(dense.rc, moe.rc))


def _moe_notes(config) -> tuple:
    out = ["mixture of experts: routing balanced (each of a rank's E/ep experts gets T k ep / E rows of a "
           "microbatch, its GEMMs at that size); dispatch and combine all-to-alls exposed (not overlapped with "
           "compute, as DeepSeek-V3's DualPipe does); no token dropped"]
    if config.tp > 1:
        out.append(f"1D tp={config.tp}: the MoE layers run whole on every tp rank (their router, experts and FLOPs "
                   f"repeated {config.tp} times, not split; attention and the dense MLPs split)")
    if config.sp > 1:
        out.append(f"sp={config.sp}: each sp rank routes its own seq / {config.sp} tokens of a row; ep over dp x sp")
    return tuple(out)


def _tp_param_split(config) -> int:
    """How many ways the tensor mode cuts a weight: tp, except 2.5D (replicated over its depth: q^2)."""
    return config.tp_q ** 2 if config.tp_mode == "2.5d" else config.tp


def _per_op(hw: Hardware) -> str:
    """The host's seconds an operator, as the assumptions say it: per family where measured."""
    measured = ", ".join(f"{f} {s * 1e6:.3g}" for f, s in hw.family_op_seconds.items())
    return (f"{measured} us an operator of each family's own step, else {hw.op_seconds * 1e6:.3g} us" if measured
            else f"{hw.op_seconds * 1e6:g} us an operator dispatched")


@functools.lru_cache(maxsize=64)
def _assumptions(hw: Hardware, precision: str) -> tuple:
    """Every figure the model takes from ``hw`` with its source, then the model's own choices."""
    out = [f"{hw.name}: {precision} matmul peak {hw.peak(precision) / 1e12:g} TFLOP/s ({hw.sources.get('flops')})",
           f"achievable matmul: {hw.e_max:.3g} of peak x d/(d+{hw.knee:g}) per GEMM dimension "
           f"({hw.sources.get('e_max, knee')})",
           f"HBM {hw.memory_bytes_per_s / 1e12:g} TB/s ({hw.sources.get('memory_bytes_per_s')}), "
           f"{hw.hbm_efficiency:g} of it reached ({hw.sources.get('hbm_efficiency')})",
           f"memory {hw.device_bytes / 1e9:g} GB per GPU ({hw.sources.get('device_bytes')}); "
           f"{hw.alloc_fixed_bytes / 2 ** 30:g} GiB fixed ({hw.sources.get('alloc_fixed_bytes')}) and "
           f"{hw.alloc_fraction:g} lost ({hw.sources.get('alloc_fraction')})",
           f"NVLink {hw.intra[1] / 1e9:g} GB/s each way per GPU ({hw.sources.get('nvlink')}), "
           f"{hw.intra[0] * 1e6:g} us a hop ({hw.sources.get('latency')})",
           f"{hw.nics_per_node} NICs of {hw.nic_bytes_per_s / 1e9:g} GB/s per node of {hw.gpus_per_node} GPUs "
           f"({hw.sources.get('nics')}), {hw.inter[0] * 1e6:g} us a network hop",
           f"NCCL bus bandwidth {hw.bus_efficiency[0]:g} of NVLink, {hw.bus_efficiency[1]:g} of the network "
           f"({hw.sources.get('bus_efficiency')})",
           f"PCIe {hw.pcie_bytes_per_s / 1e9:g} GB/s each way ({hw.sources.get('pcie')})",
           f"{hw.kernel_seconds * 1e6:g} us per kernel ({hw.sources.get('kernel_seconds')})",
           (f"the host's floor: {_per_op(hw)} ({hw.sources.get('op_seconds')}), "
            f"operators counted on the engine (planner.cluster.host)" if hw.stack.name in host.EAGER_STACKS else
            f"no host floor priced: stack {hw.stack.name} is not the engine's eager PyTorch"),
           "fp32 matmuls without TF32 (PyTorch's default); gradients reduced in fp32 (the engine's recipe)",
           ("tp collectives under their GEMMs (all but the first of tp chunks)" if hw.stack.tp_overlap else
            "tp collectives not overlapped") + "; dp gradient reduction hidden behind the last microbatch's backward "
           "except its last bucket; " + ("ZeRO 1-2's parameter all-gather under the next forward but one block's "
                                         "bucket" if hw.stack.param_gather == "overlapped" else
                                         "ZeRO 1-2's parameter all-gather after the update, exposed")
           + "; ZeRO-3 gathers behind their block's compute" + (", one per parameter tensor" if
                                                                hw.stack.zero3_gather == "tensor" else "")
           + "; ring attention's rotations behind the attention core", attention_note(hw, precision)]
    return tuple(out)

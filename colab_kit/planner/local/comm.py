"""The collectives of a step in the cost model (``planner.local.step``): tp, sp and dp, ZeRO's buckets and gathers.

Each collective costs ``alpha + wire / beta`` with the measured constants of its op on a group of its
size (``constants``), ``wire`` as ``comm.wire_bytes`` counts it. The counts follow the engine's own
code: ``tensor.block_collectives`` and ``tensor.linear_comm_bytes`` for tp, the sequence modes' messages
for sp, the buckets ``ZeroStage0`` fills (``_bucket_count``) for dp and ZeRO 1/2, ``zero.stage3``'s
gathers and reduce-scatters with their prefetches for ZeRO 3.
"""
from __future__ import annotations

from ...comm import wire_bytes
from ...memory.estimator import part_params, stage_params
from ...memory.layout import stage_plan
from ...memory.formulas import PRECISION_BYTES
from ...observe.measured import alpha_beta
from ...tensor import block_collectives, linear_comm_bytes
from ...zero.stage0 import default_bucket_bytes, fill_buckets
from ...zero.stage2 import stage2_bucket_size

__all__ = ["collective_seconds", "dp_comm", "engine_buckets", "forward_share", "shares_cores", "sp_comm", "tp_comm"]

_MAIN_OP = {"1d": "all_reduce", "2d": "broadcast", "2.5d": "broadcast", "3d": "all_gather"}


def collective_seconds(consts, op: str, payload: int, n: int, count: int = 1) -> float:
    """Seconds of ``count`` collectives ``op`` of ``payload`` bytes each on ``n`` ranks."""
    if n <= 1 or count == 0:
        return 0.0
    alpha, beta = alpha_beta(consts, op, n)
    return count * (alpha + wire_bytes("send" if op == "sendrecv" else op, payload, n) / beta)


def tp_comm(model, cfg, consts, tokens: int, layers: int, head: bool, e: int) -> tuple[float, int]:
    """Seconds and collectives of the tensor plan in one microbatch's forward and backward."""
    if cfg.tp == 1:
        return 0.0, 0
    h, f, v = model.d_model, model.d_ff, model.vocab_size
    n = cfg.tp if cfg.tp_mode == "1d" else cfg.tp_q
    rows = tokens // cfg.sp
    lin = [(h, 3 * h, "column"), (h, h, "row"), (h, f, "column"), (f, h, "row")]
    payload = sum(sum(linear_comm_bytes(cfg, rows, i, o, k, e)[d] for d in ("forward", "backward")) for i, o, k in lin)
    counts = block_collectives(cfg)
    main = "all_gather" if cfg.sp_mode == "split_gather" else _MAIN_OP[cfg.tp_mode]
    per_call = payload / max(1, sum(counts.values()))
    seconds = layers * sum(collective_seconds(consts, op, int(per_call), n, c) for op, c in counts.items())
    count = layers * sum(counts.values())
    if head:  # the head Linear, the loss's three small all-reduces (max, sum, target logit)
        hb = linear_comm_bytes(cfg, rows, h, v, "column", e)
        seconds += (collective_seconds(consts, main, hb["forward"] + hb["backward"], n)
                    + collective_seconds(consts, "all_reduce", 4 * rows, n, 3))
        count += 4
    return seconds, count


def forward_share(cfg) -> tuple[float, float]:
    """The forward's share of a block's tp collectives and of its sp ones, by count (the latency of a
    small collective is most of its time): 1D and split_gather half each way; SUMMA 2 broadcasts a
    step for each Linear forward, a broadcast and a reduce for dX and for dW back, LayerNorm's sums half
    each way; 3D 3 collectives each way a Linear; Ulysses 2 all-to-alls each way; ring sp - 1
    rotations forward of its 3 sp - 2."""
    tp = (8 * cfg.tp_q + 4) / (24 * cfg.tp_q + 8) if cfg.tp > 1 and cfg.tp_mode in ("2d", "2.5d") else 0.5
    sp = (cfg.sp - 1) / (3 * cfg.sp - 2) if cfg.sp > 1 and cfg.sp_mode == "ring" else 0.5
    return tp, sp


def sp_comm(model, cfg, consts, tokens: int, layers: int, e: int) -> tuple[float, int]:
    if cfg.sp == 1:
        return 0.0, 0
    kv = 2 * tokens // cfg.sp * model.d_model // cfg.tp * e  # K and V of this rank's tokens, one message
    if cfg.sp_mode == "ring":  # sp - 1 rotations forward; backward sp - 1 of K/V and sp of the dK/dV sums
        count = 3 * cfg.sp - 2
        return layers * collective_seconds(consts, "sendrecv", kv, cfg.sp, count), layers * count
    # Ulysses: q, k, v in one all-to-all and the output in another, each reversed in backward
    return layers * collective_seconds(consts, "all_to_all", kv, cfg.sp, 4), layers * 4


def dp_comm(model, cfg, consts, memory, block_fwd: float = 0.0, block_rc: float = 0.0,
            scale: float = 1.0) -> tuple[float, int]:
    """Seconds of the dp collectives a step waits for, and their count. ``block_fwd``, ``block_rc``: one
    block's forward and recomputation seconds on one microbatch (ZeRO 3 hides its prefetches behind them). The
    group: dp x sp (``ParallelConfig.zero_ranks``). ``scale``: the rank's gradients over ``model``'s (a mixture
    of experts priced as its active GPT reduces every parameter it holds)."""
    n = cfg.zero_ranks  # the sp ranks' gradient sum joins the dp reduction (zero.reduction_axis)
    if n == 1:
        return 0.0, 0
    if cfg.zero == 3:
        return _zero3(model, cfg, consts, block_fwd, block_rc, scale)
    bucket, nb = engine_buckets(model, cfg, shares_cores(consts, cfg))
    bucket = round(bucket * scale)
    wire = bucket * 4 // PRECISION_BYTES[cfg.precision]  # gradients are reduced in fp32 (colab_kit.precision)
    if cfg.zero:  # stage 2 without a pipeline reduce-scatters every microbatch's buckets (zero.stage2)
        rounds = cfg.microbatches if cfg.zero == 2 and cfg.pp == 1 else 1
        rs = collective_seconds(consts, "reduce_scatter", wire, n, rounds * nb)
        return rs + collective_seconds(consts, "all_gather", bucket // n, n, nb), (rounds + 1) * nb
    # the first bucket's all-reduce runs while backward goes on, where a core is free to run it. With more
    # ranks than cores it cannot finish before the slowest peer's backward does, and it waits like the
    # rest: dp=4 on 4 ranks / 2 cores, GPTs of 2-8 blocks, every step 3-4 ms (a bucket) above the model
    # that hid it. (ZeRO 3's prefetches, issued a block ahead with every rank at the same block, are
    # half hidden there: ``_zero3``.)
    hidden = 1 if consts.get("cores", cfg.world_size) >= cfg.world_size and nb > 1 else 0
    return collective_seconds(consts, "all_reduce", wire, n, nb - hidden), nb


def shares_cores(consts, cfg) -> bool:
    """Whether ``cfg``'s ranks share the cores the constants were measured on (more ranks than ``cores``):
    the engine then fills one gradient bucket (``launch.ranks_share_cores``)."""
    return consts.get("cores", cfg.world_size) < cfg.world_size


def engine_buckets(model, cfg, shared_cores: bool = False) -> tuple[int, int]:
    """(bytes a bucket holds, buckets) of the fullest rank's gradients as the engine makes them, in the
    parameters' own bytes (16-bit under bf16/fp16): about two (``zero.stage0.default_bucket_bytes``; one
    where the ranks share the host's cores, ``shared_cores``), 2 dp sp at ZeRO stage 2
    (``zero.stage2.stage2_bucket_size``)."""
    e = PRECISION_BYTES[cfg.precision]
    total = max(stage_params(model, cfg)) * e
    bucket = stage2_bucket_size(total, cfg.zero_ranks) if cfg.zero == 2 else default_bucket_bytes(total, shared_cores)
    return bucket, _bucket_count(model, cfg, bucket, e)


def _bucket_count(model, cfg, bucket: int, e: int) -> int:
    """Buckets the engine fills from the fullest rank's gradients (``zero.stage0.fill_buckets``: a bucket
    runs over by up to a parameter, so the count can fall short of ``total / bucket``). A GPT block's 12 parameters (1D
    tensor splits; other modes' blocks scaled to their size), the embeddings on the rank that holds stage
    0 and the tail on the one that holds the last (both on zb-v's rank 0)."""
    h, f, v, t = model.d_model, model.d_ff, model.vocab_size, model.seq_len
    parts = part_params(model, cfg)
    if cfg.tp == 1 or cfg.tp_mode == "1d":
        p = cfg.tp
        block = [h, h, 3 * h * h // p, 3 * h // p, h * h // p, h, h, h, f * h // p, f // p, h * f // p, h]
        embed, tail = [v * h // p, t * h], [h, h, v * h // p]
    else:  # 2D / 2.5D / 3D: the block's parameters in the same proportions, the tables and the tail whole
        dense = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h]
        block = [round(x * parts["block"] / sum(dense)) for x in dense]
        embed, tail = [parts["embed"]], [parts["tail"]]
    n = cfg.pp * cfg.chunks
    if cfg.pp == 1:
        sizes = embed + block * model.n_layers + tail
    else:
        plan, stage_layers = stage_plan(cfg, model)
        layers = stage_layers(model.n_layers, n)
        per_rank = stage_params(model, cfg)
        fullest = max(range(cfg.pp), key=per_rank.__getitem__)
        sizes = []
        for s in sorted(plan.stages_of(fullest)):
            sizes += (embed if s == 0 else []) + block * len(layers[s]) + (tail if s == n - 1 else [])
    return max(1, len(fill_buckets([x * e for x in sizes], bucket)))


def _zero3(model, cfg, consts, f: float, rc: float, scale: float = 1.0) -> tuple[float, int]:
    """ZeRO 3 (``zero.stage3``), per microbatch, L blocks on this rank, g one block's all-gather, r its
    reduce-scatter, E the embeddings' and T the tail's (``zero.units``): forward, E's and block 0's gathers
    are waited for, each next unit's (T's too) is prefetched while the block before computes (``f``), so
    ``max(0, g - f)`` shows; backward, T's reduce-scatter and the last block's gather are waited for (one
    process group runs them in order), then each block's backward (``2 f`` and its recomputation) hides the
    prefetch of the unit before (block 0's: E's, gathered again for its backward) and its own reduce-scatter,
    which run one after the other: ``max(0, g + r - (2 f + rc))``; E's reduce-scatter at the end. Per
    microbatch ``2 L + 3`` all-gathers (E twice, T once) and ``L + 2`` reduce-scatters. With fewer cores than
    ranks a collective in flight overlaps the compute only for the ``cores / ranks`` share of the time its peers
    get a core: on 4 CPU ranks / 2 cores a ZeRO 3 step (dp=4, recompute, the 4-block test GPT) measured
    60-68 ms, where every collective counted whole made 86 and every prefetch hidden 52-57."""
    parts, n = {k: round(v * scale) for k, v in part_params(model, cfg).items()}, cfg.zero_ranks  # over dp x sp
    layers = model.n_layers // cfg.pp
    g = collective_seconds(consts, "all_gather", parts["block"] * 4 // n, n)
    r = collective_seconds(consts, "reduce_scatter", parts["block"] * 4, n)
    g_embed = collective_seconds(consts, "all_gather", parts["embed"] * 4 // n, n)
    r_embed = collective_seconds(consts, "reduce_scatter", parts["embed"] * 4, n)
    g_tail = collective_seconds(consts, "all_gather", parts["tail"] * 4 // n, n)
    r_tail = collective_seconds(consts, "reduce_scatter", parts["tail"] * 4, n)
    share = min(1.0, consts.get("cores", cfg.world_size) / cfg.world_size)

    def shown(x, behind):  # the part of ``x`` not hidden behind ``behind`` of compute: with fewer cores than
        return x - share * min(x, behind)  # ranks only a ``cores / ranks`` share of it overlaps
    forward = g_embed + g + (layers - 1) * shown(g, f) + shown(g_tail, f)
    backward = (r_tail + g + (layers - 1) * shown(g + r, 2 * f + rc) + shown(r + g_embed, 2 * f + rc)
                + r_embed)
    m = cfg.microbatches
    return m * (forward + backward), m * (2 * layers + 3 + layers + 2)

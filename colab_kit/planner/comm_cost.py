"""The collectives of a step in the cost model (``planner.cost``): tp, sp and dp, ZeRO's buckets and gathers.

Each collective costs ``alpha + wire / beta`` with the measured constants of its op on a group of its
size (``constants``), ``wire`` as ``comm.wire_bytes`` counts it. The counts follow the engine's own
code: ``tensor.block_collectives`` and ``tensor.linear_comm_bytes`` for tp, the sequence modes' messages
for sp, the buckets ``ZeroStage0`` fills (``_bucket_count``) for dp and ZeRO 1/2, ``zero.stage3``'s
gathers and reduce-scatters with their prefetches for ZeRO 3.
"""
from __future__ import annotations

from ..comm import wire_bytes
from ..memory.estimator import part_params, stage_params
from ..tensor import block_collectives, linear_comm_bytes
from ..zero.stage0 import default_bucket_bytes

_MAIN_OP = {"1d": "all_reduce", "2d": "broadcast", "2.5d": "broadcast", "3d": "all_gather"}


def _op(consts, op: str, n: int) -> tuple[float, float]:
    """(alpha, beta) of ``op`` on a group of ``n`` ranks (the nearest group size measured)."""
    comm = consts["comm"]
    key = str(n) if str(n) in comm else min(comm, key=lambda k: abs(int(k) - n))
    op = {"reduce": "broadcast", "recv": "send"}.get(op, op)
    c = comm[key].get(op) or comm[key]["send"]  # constants measured before sendrecv had its own
    return c["alpha"], c["beta"]


def _coll(consts, op: str, payload: int, n: int, count: int = 1) -> float:
    """Seconds of ``count`` collectives ``op`` of ``payload`` bytes each on ``n`` ranks."""
    if n <= 1 or count == 0:
        return 0.0
    alpha, beta = _op(consts, op, n)
    return count * (alpha + wire_bytes("send" if op == "sendrecv" else op, payload, n) / beta)


def _tp_comm(model, cfg, consts, tokens: int, layers: int, head: bool, e: int) -> tuple[float, int]:
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
    seconds = layers * sum(_coll(consts, op, int(per_call), n, c) for op, c in counts.items())
    count = layers * sum(counts.values())
    if head:  # the head Linear, the loss's three small all-reduces (max, sum, target logit)
        hb = linear_comm_bytes(cfg, rows, h, v, "column", e)
        seconds += _coll(consts, main, hb["forward"] + hb["backward"], n) + _coll(consts, "all_reduce", 4 * rows, n, 3)
        count += 4
    return seconds, count


def _forward_share(cfg) -> tuple[float, float]:
    """The forward's share of a block's tp collectives and of its sp ones, by count (the latency of a
    small collective is most of its time): 1D and split_gather half each way; SUMMA 2 broadcasts a
    step for each Linear forward, a broadcast and a reduce for dX and for dW back, LayerNorm's sums half
    each way; 3D 3 collectives each way a Linear; Ulysses 2 all-to-alls each way; ring sp - 1
    rotations forward of its 3 sp - 2."""
    tp = (8 * cfg.tp_q + 4) / (24 * cfg.tp_q + 8) if cfg.tp > 1 and cfg.tp_mode in ("2d", "2.5d") else 0.5
    sp = (cfg.sp - 1) / (3 * cfg.sp - 2) if cfg.sp > 1 and cfg.sp_mode == "ring" else 0.5
    return tp, sp


def _sp_comm(model, cfg, consts, tokens: int, layers: int, e: int) -> tuple[float, int]:
    if cfg.sp == 1:
        return 0.0, 0
    kv = 2 * tokens // cfg.sp * model.d_model // cfg.tp * e  # K and V of this rank's tokens, one message
    if cfg.sp_mode == "ring":  # sp - 1 rotations forward; backward sp - 1 of K/V and sp of the dK/dV sums
        count = 3 * cfg.sp - 2
        return layers * _coll(consts, "sendrecv", kv, cfg.sp, count), layers * count
    # Ulysses: q, k, v in one all-to-all and the output in another, each reversed in backward
    return layers * _coll(consts, "all_to_all", kv, cfg.sp, 4), layers * 4


def _dp_comm(model, cfg, consts, memory, block_fwd: float = 0.0, block_rc: float = 0.0) -> tuple[float, int]:
    """Seconds of the dp collectives a step waits for, and their count. ``block_fwd``, ``block_rc``: one
    block's forward and recomputation seconds on one microbatch (ZeRO 3 hides its prefetches behind them)."""
    if cfg.dp == 1:
        return 0.0, 0
    e = 4  # gradients are reduced in fp32 (colab_kit.engine.precision)
    params = max(stage_params(model, cfg))
    total = params * e
    if cfg.zero == 3:
        return _zero3(model, cfg, consts, block_fwd, block_rc)
    # the engine's buckets: about two (ZeroStage0), 2 dp at stage 2 (each a piece's size, zero.stage2)
    bucket = min(25 << 20, max(64 << 10, total // (2 * cfg.dp))) if cfg.zero == 2 else default_bucket_bytes(total)
    nb = _bucket_count(model, cfg, bucket, e)
    if cfg.zero:  # stage 2 without a pipeline reduce-scatters every microbatch's buckets (zero.stage2)
        rounds = cfg.microbatches if cfg.zero == 2 and cfg.pp == 1 else 1
        rs = _coll(consts, "reduce_scatter", bucket, cfg.dp, rounds * nb)
        return rs + _coll(consts, "all_gather", bucket // cfg.dp, cfg.dp, nb), (rounds + 1) * nb
    # the first bucket's all-reduce runs while backward goes on, where a core is free to run it: with
    # more ranks than cores every rank's core is busy with its backward, and it waits like the rest
    hidden = 1 if consts.get("cores", cfg.world_size) >= cfg.world_size and nb > 1 else 0
    return _coll(consts, "all_reduce", bucket, cfg.dp, nb - hidden), nb


def _bucket_count(model, cfg, bucket: int, e: int) -> int:
    """Buckets the engine fills from the fullest rank's gradients: parameters in reverse order, a bucket
    closed once it holds ``bucket`` bytes or more (``ZeroStage0``), so a bucket runs over by up to a
    parameter and the count can fall short of ``total / bucket``. A GPT block's 12 parameters (1D
    tensor splits; other modes' blocks scaled to their size), the embeddings and the tail."""
    h, f, v, t = model.d_model, model.d_ff, model.vocab_size, model.seq_len
    p = cfg.tp if cfg.tp_mode == "1d" else 1
    dense = [h, h, 3 * h * h // p, 3 * h // p, h * h // p, h, h, h, f * h // p, f // p, h * f // p, h]
    parts = part_params(model, cfg)
    scale = parts["block"] / sum(dense)
    layers = model.n_layers // cfg.pp
    sizes = [v * h // p, t * h] if cfg.pp == 1 or parts["embed"] >= parts["tail"] else []
    sizes += [round(x * scale) for x in dense] * layers
    sizes += [h, h, v * h // p] if cfg.pp == 1 or parts["tail"] > parts["embed"] else []
    count, held = 0, 0
    for x in reversed(sizes):
        held += x * e
        if held >= bucket:
            count, held = count + 1, 0
    return max(1, count + (held > 0))


def _zero3(model, cfg, consts, f: float, rc: float) -> tuple[float, int]:
    """ZeRO 3 (``zero.stage3``), per microbatch, L blocks on this rank, g one block's all-gather, r its
    reduce-scatter, R the rest (embeddings and the tail, gathered once and reduce-scattered last):
    forward, R's and block 0's gathers are waited for, each next block's is prefetched while the block
    before computes (``f``), so ``max(0, g - f)`` shows; backward, the last block's gather is waited for,
    then each block's backward (``2 f`` and its recomputation) hides the prefetch of the one before and
    its own reduce-scatter, which share one process group and so run one after the other:
    ``max(0, g + r - (2 f + rc))``; R's reduce-scatter at the end. On 4 CPU ranks a ZeRO 3 step of the
    4-block test GPT measured 60 ms where every collective counted whole made 86."""
    parts = part_params(model, cfg)
    layers = model.n_layers // cfg.pp
    g = _coll(consts, "all_gather", parts["block"] * 4 // cfg.dp, cfg.dp)
    r = _coll(consts, "reduce_scatter", parts["block"] * 4, cfg.dp)
    rest = (parts["embed"] + parts["tail"]) * 4
    g_rest = _coll(consts, "all_gather", rest // cfg.dp, cfg.dp)
    r_rest = _coll(consts, "reduce_scatter", rest, cfg.dp)
    forward = g_rest + g + (layers - 1) * max(0.0, g - f)
    backward = g + (layers - 1) * max(0.0, g + r - (2 * f + rc)) + max(0.0, r - (2 * f + rc)) + r_rest
    m = cfg.microbatches
    return m * (forward + backward), m * (2 * layers + 1 + layers + 1)

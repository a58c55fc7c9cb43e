"""Seconds per ``train_step`` of one config: compute plus communication, from measured constants.

Per rank of the fullest pipeline stage, one step of ``m`` microbatches:

- compute: FLOPs from the model by the standard count, forward ``2 N`` per token for the N
  matmul parameters (q/k/v, proj, fc1, fc2, head) plus ``4 t h`` per token for attention's two
  products (the CPU kernel computes the whole ``t x t`` square: no causal halving), divided by
  tp (every mode splits the matmuls evenly) and sp (tokens); backward twice the forward,
  recomputation one more forward. Each autograd op of the forward (counted once on a tiny GPT of the same structure) the measured
  dispatch overhead per op (``constants``'s "dispatch"), which is what a small model spends most on.
  Seconds = FLOPs / the matmul rate measured with this many ranks running at once
  (``constants``: it already includes ranks sharing the cores).
- pipeline: the schedule's own timeline (``pipeline.simulate`` on the plan the engine runs, zb-v's
  ordered on the stages' FLOPs; F = 1, B = 2, I = W = 1,
  B = 3 and I = 2 with recomputation), scaled to the stage's forward seconds; what the
  fullest rank is idle is the bubble. The measured rates are per rank with all ranks busy; with
  R ranks on C < R cores a rank runs at C/R of its own speed, and a rank idle in the bubble frees
  its core, so the step is max(makespan x C/R, busy) in those units: no bubble at all on a
  machine with 4 ranks on 2 cores, the full bubble with a core per rank. A stage's tp and sp
  collectives are part of each of its slots (fill and drain included) and are not sped up by
  idle cores: with ``c`` their seconds per unit of the schedule, the bubble is
  ``max(0, span (fwd C/R + c) - busy (fwd + c))``.
- communication, ``alpha + wire / beta`` per collective with the group's measured constants:
  dp gradients in the buckets of ``data.default_bucket_bytes``, all but the first (which runs
  while backward goes on) exposed (ZeRO 1/2 reduce-scatter them
  and all-gather the parameters; ZeRO 3 gathers each block's parameters in forward and again in
  backward and reduce-scatters its gradients); tp: the counts of
  ``tensor.block_collectives`` and the bytes of ``tensor.linear_comm_bytes`` for the four
  Linears of every block and the head; sp: ring's K/V rotations (``sp - 1`` forward; ``sp - 1``
  back and ``sp`` passes of the dK/dV sums) or Ulysses' two all-to-alls each way (q, k, v
  together, then the output); pp: a send of the stage's output per microbatch
  and one of its gradient back, whose bytes all count but whose latency only on the first
  microbatch's way through the stages and back (receives are posted ahead, sends do not block). Wire bytes are ``comm.wire_bytes``, as the comm records count.
- optimizer: its bytes read and written once (params, grads, states of this rank's shard) at
  the measured memory rate; offload='cpu' adds copying the gradients out and parameters back; and
  its ops: ``OPS_PER_TENSOR`` for each tensor it steps (``stepped_tensors``) at the measured seconds
  per optimizer op (``constants``'s "optimizer"). Profiled on 4 CPU ranks, AdamW's step on a
  4-block GPT took 5-9 ms where its bytes alone gave 0.2.
"""
from __future__ import annotations

import dataclasses
import functools

from ..comm import wire_bytes
from ..zero.stage0 import default_bucket_bytes
from ..memory.estimator import part_params, stage_params
from ..memory.formulas import PRECISION_BYTES
from ..pipeline.costs import flops_per_token
from ..tensor import block_collectives, linear_comm_bytes

__all__ = ["step_seconds"]

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


@functools.lru_cache(maxsize=512)
def _pipeline_units(schedule: str, pp: int, m: int, chunks: int, recompute: bool,
                    model_key: tuple) -> tuple[float, float]:
    """(makespan, busy time of the busiest rank) of the plan the engine runs (``build_plan_for``),
    in units of one stage forward. ``model_key``: the model config's class and fields (hashable)."""
    from ..config import ParallelConfig
    from ..pipeline import build_plan_for, simulate
    costs = {"F": 1, "B": 3, "I": 2, "W": 1} if recompute else {"F": 1, "B": 2, "I": 1, "W": 1}
    cls, fields = model_key
    plan = build_plan_for(ParallelConfig(pp=pp, microbatches=m, schedule=schedule, chunks=chunks), cls(**dict(fields)))
    t = simulate(plan, costs)
    return float(t.makespan), float(max(t.busy))


def _forward(model, cfg, consts, tokens: int, layers: int, head: bool) -> float:
    """Seconds of one forward on this rank: ``tokens`` per microbatch, ``layers`` blocks, the head."""
    lin, att, head_flops = flops_per_token(model)
    tok = tokens / cfg.sp  # this rank's tokens; attention reaches the whole sequence, split over sp too
    flops = layers * tok * (lin + att / cfg.sp) + (tok * head_flops if head else 0)
    block_ops, head_ops = _op_counts(model.n_heads)
    ops = layers * (block_ops + mode_ops(cfg)) + (head_ops if head else 0)
    overhead = ops * consts.get("dispatch", {}).get("op_seconds", 0.0)
    return flops / cfg.tp / consts["matmul"]["flops_per_s"] + overhead


def mode_ops(cfg) -> int:
    """Ops a block's forward runs on top of the dense block's in ``cfg``'s layers, counted from
    their source: ring attention (``sequence.ring``) replaces one fused attention call by 2 sp + 1
    causal chunk pairs per rank (zigzag), each a block forward (scores, mask, log-sum-exp,
    exp, matmul: about 9 ops) merged into the running result (``merge_lse``: about 8); Ulysses
    its two all-to-alls with the stacking and reshapes around them (6); 1D one autograd collective per Linear (4),
    split_gather two (8); SUMMA (2D, 2.5D) q steps of two broadcasts, a matmul and an add per
    Linear (16 q) and LayerNorm2D's explicit statistics (about 9 ops each instead of one); 3D two
    all-gathers and a reduce-scatter per Linear (12) and LayerNorm3D's statistics."""
    extra = 0
    if cfg.sp > 1:
        extra += 17 * (2 * cfg.sp + 1) if cfg.sp_mode == "ring" else 6
    if cfg.tp > 1:
        if cfg.tp_mode == "1d":
            extra += 8 if cfg.sp_mode == "split_gather" else 4
        elif cfg.tp_mode in ("2d", "2.5d"):
            extra += 16 * cfg.tp_q + 16
        else:
            extra += 12 + 16
    return extra


@functools.lru_cache(maxsize=64)
def _op_counts(heads: int) -> tuple[int, int]:
    """Autograd ops of one block and of the embeddings + ln_f + head + loss (a tiny GPT of the
    same structure, counted once: the count does not depend on the sizes)."""
    import torch
    import torch.nn.functional as F

    from ..models import GPT, GPTConfig
    from .constants import count_ops
    g = GPTConfig(vocab_size=8, seq_len=4, d_model=2 * heads, n_heads=heads, n_layers=1)
    model, x = GPT(g), torch.zeros(1, 4, dtype=torch.long)
    whole = count_ops(lambda: F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
    block = count_ops(lambda: model.blocks[0](torch.zeros(1, 4, 2 * heads, requires_grad=True)).sum()) - 1
    return block, whole - block


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


def _sp_comm(model, cfg, consts, tokens: int, layers: int, e: int) -> tuple[float, int]:
    if cfg.sp == 1:
        return 0.0, 0
    kv = 2 * tokens // cfg.sp * model.d_model // cfg.tp * e  # K and V of this rank's tokens, one message
    if cfg.sp_mode == "ring":  # sp - 1 rotations forward; backward sp - 1 of K/V and sp of the dK/dV sums
        count = 3 * cfg.sp - 2
        return layers * _coll(consts, "sendrecv", kv, cfg.sp, count), layers * count
    # Ulysses: q, k, v in one all-to-all and the output in another, each reversed in backward
    return layers * _coll(consts, "all_to_all", kv, cfg.sp, 4), layers * 4


def step_seconds(model, cfg, batch: int, consts: dict, memory: dict, optimizer: str = "adamw") -> tuple[float, dict, dict]:
    """(seconds, breakdown by part, collectives per step by part) of one train_step of ``cfg``."""
    e = PRECISION_BYTES[cfg.precision]
    m = cfg.microbatches
    tokens = batch // (cfg.dp * m) * model.seq_len
    n_stages = cfg.pp * cfg.chunks
    layers_stage = model.n_layers // n_stages
    layers_rank = layers_stage * cfg.chunks
    parts, counts = {}, {}
    if cfg.pp == 1:
        fwd = _forward(model, cfg, consts, tokens, model.n_layers, True)
        parts["compute"] = m * fwd * (4 if cfg.recompute else 3)
    else:
        fwd = _forward(model, cfg, consts, tokens, layers_stage, False)
        model_key = (type(model), tuple(dataclasses.asdict(model).items()))
        span, busy = _pipeline_units(cfg.schedule, cfg.pp, m, cfg.chunks, cfg.recompute, model_key)
        head = _forward(model, cfg, consts, tokens, 0, True) * m * 3
        parts["compute"] = busy * fwd + head
        # more ranks than cores: a rank waiting in the bubble gives its core to one that computes, so
        # the step is the longer of the schedule at one rank's own speed and the work shared out
        share = min(1.0, consts.get("cores", cfg.world_size) / cfg.world_size)
        # a stage's tp and sp collectives lengthen every slot of the schedule, the fill and drain
        # slots too, and waiting on a peer is not sped up by idle cores: per unit of the schedule
        # (a forward is one, a backward two) the microbatch's in-stage communication over its units
        tp1, _ = _tp_comm(model, cfg, consts, tokens, layers_stage, False, e)
        sp1, _ = _sp_comm(model, cfg, consts, tokens, layers_stage, e)
        unit = (tp1 + sp1) / (busy / (m * cfg.chunks))
        parts["bubble"] = max(0.0, span * (fwd * share + unit) - busy * (fwd + unit))
        act = tokens // cfg.sp * model.d_model * e // (cfg.tp if cfg.tp_mode != "1d" else 1)
        sends = 2 * m * cfg.chunks
        alpha, beta = _op(consts, "send", 2)
        # receives are posted ahead and sends do not block: only the first microbatch's way down the
        # pipeline and its gradient's way back wait for a message's latency; the bytes all pass
        parts["comm:pp"] = 2 * (cfg.pp * cfg.chunks - 1) * alpha + sends * act / beta
        counts["pp"] = sends
    tp_s, tp_n = _tp_comm(model, cfg, consts, tokens, layers_rank, True, e)  # the head's rank is the slowest
    parts["comm:tp"], counts["tp"] = m * tp_s, m * tp_n
    sp_s, sp_n = _sp_comm(model, cfg, consts, tokens, layers_rank, e)
    parts["comm:sp"], counts["sp"] = m * sp_s, m * sp_n
    dp_s, dp_n = _dp_comm(model, cfg, consts, memory)
    parts["comm:dp"], counts["dp"] = dp_s, dp_n
    if cfg.sp > 1:  # gradients of the parameters replicated over sp, one flat all-reduce
        parts["comm:sp"] += _coll(consts, "all_reduce", memory["grads"] * (cfg.dp if cfg.zero >= 2 else 1), cfg.sp)
    parts["optimizer"] = _optimizer(cfg, consts, memory, model, optimizer)
    loss = sum(_coll(consts, "all_reduce", 4, n) for n in (cfg.dp, cfg.sp, cfg.tp, cfg.pp))
    parts["comm:loss"] = loss
    parts = {k: v for k, v in parts.items() if v > 0}
    return sum(parts.values()), parts, {k: v for k, v in counts.items() if v}


def _dp_comm(model, cfg, consts, memory) -> tuple[float, int]:
    if cfg.dp == 1:
        return 0.0, 0
    e = 4  # gradients are reduced in fp32 (colab_kit.engine.precision)
    params = max(stage_params(model, cfg))
    total = params * e
    if cfg.zero == 3:
        parts = part_params(model, cfg)
        block = parts["block"] * e
        n = model.n_layers + 2
        gather = _coll(consts, "all_gather", block // cfg.dp, cfg.dp, 2 * n)
        return gather + _coll(consts, "reduce_scatter", block, cfg.dp, n), 3 * n
    bucket = default_bucket_bytes(total)
    nb = -(-total // bucket)
    if cfg.zero:
        rs = _coll(consts, "reduce_scatter", bucket, cfg.dp, nb)
        return rs + _coll(consts, "all_gather", bucket // cfg.dp, cfg.dp, nb), 2 * nb
    return _coll(consts, "all_reduce", bucket, cfg.dp, max(1, nb - 1)), nb  # the first bucket overlaps backward


OPS_PER_TENSOR = {"adamw": 10, "adam": 10, "sgd-momentum": 3, "sgd": 3, "sgd-nomomentum": 1}
"""Ops torch's optimizers dispatch per tensor they step (counted on CPU, torch 2.13: AdamW 532 for 53 tensors)."""


def stepped_tensors(model, cfg) -> int:
    """Tensors the optimizer steps on the fullest rank: a GPT's own (12 a block, the token and position
    tables, the final norm and the head) without ZeRO; one flat piece per gradient bucket at stages 1-2;
    one per chunk at stage 3 (each block, the embeddings, the tail)."""
    if cfg.zero == 3:
        return model.n_layers // cfg.pp + 2
    if cfg.zero in (1, 2):
        total = max(stage_params(model, cfg)) * 4
        return -(-total // default_bucket_bytes(total))
    layers = model.n_layers // cfg.pp
    return 12 * layers + (5 if cfg.pp == 1 else 3)  # tables (2) on the first stage, norm + head (3) on the last


def _optimizer(cfg, consts, memory, model=None, optimizer: str = "adamw") -> float:
    touched = memory["params"] // (cfg.dp if cfg.zero in (1, 2) else 1) + memory["grads"] + memory["optimizer"]
    seconds = 2 * touched / consts["memory"]["bytes_per_s"]
    if cfg.offload == "cpu":
        seconds += 2 * memory["grads"] / consts["memory"]["bytes_per_s"]
    per_op = consts.get("optimizer", {}).get("op_seconds", 0.0)  # constants measured before it: bytes only
    if model is not None and per_op:
        seconds += stepped_tensors(model, cfg) * OPS_PER_TENSOR.get(optimizer, 10) * per_op
    return seconds

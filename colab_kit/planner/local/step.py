"""Seconds per ``train_step`` of one config: compute plus communication, from measured constants.

Per rank of the fullest pipeline stage, one step of ``m`` microbatches:

- compute: a forward and its backward are 3 forwards of (``_forward``) matmul FLOPs by the standard
  count (``2 N`` per token for the N matmul parameters plus ``4 t h`` for attention's two products; the
  CPU kernel computes the whole ``t x t`` square), split over tp and sp, at the measured matmul rate;
  the autograd ops of a block (counted once on a tiny GPT of the same structure, plus each mode's
  extra ops, ``mode_ops``) at the measured seconds per op; and the elementwise work, the bytes the
  forward saves for backward (``memory.formulas.activation_bytes``) at the measured seconds per byte.
  In one process on this machine that prices the 4-block test GPT's step at 3.6 ms, measured 3.61 (by hand, once).
  Recomputation (``_recomputed``) adds the blocks' FLOPs and bytes again and their ops at the measured
  cost of a recomputed op (``constants``'s "recompute": 2-3 times an op's own on CPU, the checkpoint's
  hooks), and runs the forward's tp and sp collectives again (1D: half of them); selective recomputation
  adds attention's core only (its products' FLOPs, its few ops, no collective).
- pipeline (``_span``): the schedule's own plan (``build_plan_for``) with each action's compute and
  the stage's tp and sp collectives in it: F its forward, B its backward (and recomputation), a
  zero-bubble I the backward less W, W the Linears' deferred weight gradients (``_weight_grads``:
  their FLOPs and 4 ops a Linear, so where ops dominate W is small and fills little of the
  bubble), the last stage's head and loss on top. With a core per rank ``pipeline.simulate``; with
  fewer cores than ranks, ``shared_cores.makespan``: a rank that waits leaves its core to those that compute
  (with ranks bound to cores, ``constants``'s "bound", to the ranks bound to the same core: dp=2 x pp=2 on
  2 cores runs each replica on one core), and each message between stages takes the measured send
  latency; constants of ranks the OS placed price dp replicas of a pipeline at the speed of all ranks busy
  (the replicas drift apart and the step waits for the later one). The bubble is that span less the rank's own work.
- communication, ``alpha + wire / beta`` per collective with the group's measured constants: dp
  gradients in the engine's buckets (``_bucket_count``: ``zero.stage0.default_bucket_bytes``, one where ranks share
  cores, 2 dp at ZeRO 2), all but the first exposed where a core per rank lets the first run while backward goes
  on, all of them on shared cores; ZeRO 1/2 reduce-scatter them (stage 2 without a pipeline every
  microbatch) and all-gather the parameters; ZeRO 3 (``_zero3``) gathers each block in forward and
  again in backward and reduce-scatters its gradients, the prefetches hidden behind the blocks'
  compute; tp: the counts of ``tensor.block_collectives`` and the bytes of
  ``tensor.linear_comm_bytes`` for the four Linears of every block and the head; sp: ring's K/V
  rotations (``sp - 1`` forward; ``sp - 1`` back and ``sp`` passes of the dK/dV sums) or Ulysses'
  two all-to-alls each way; pp: every message, a send of the stage's output per microbatch and one
  of its gradient back (on CPU ranks a message's latency is work both ends do). Wire bytes are
  ``comm.wire_bytes``, as the comm records count.
- optimizer (``_optimizer``): its ops, ``OPS_PER_TENSOR`` for each tensor it steps (``stepped_tensors``),
  at the measured seconds per optimizer op, and the elements it steps (this rank's shard) at the
  measured seconds per element of an AdamW step (``constants``'s "optimizer": torch's CPU AdamW makes
  about 10 passes over each tensor); offload='cpu' adds copying the gradients out and parameters back.
  Profiled on 4 CPU ranks, AdamW's step on a 4-block GPT took 5-9 ms where its bytes alone gave 0.2.

How each piece was found, with the runs that showed it: docs/planner.md#against-runs.
"""
from __future__ import annotations

import dataclasses
import functools

from ...config import Axis
from ...memory.formulas import PRECISION_BYTES, activation_bytes
from ...pipeline.costs import flops_per_token
from ...observe.measured import alpha_beta
from .comm import collective_seconds, dp_comm, engine_buckets, forward_share, shares_cores, sp_comm, tp_comm
from .bubble import bubble
from ...models import GPT, GPTConfig
from .measure_compute import count_ops

__all__ = ["step_seconds"]


def _forward(model, cfg, consts, tokens: int, layers: int, head: bool) -> float:
    """Seconds of one forward on this rank: ``tokens`` per microbatch, ``layers`` blocks, the head (with the
    embeddings and the loss). A third of what the forward and its backward take: their matmul FLOPs at
    the measured rate, their ops at the measured seconds per op (3 per forward op: a backward runs about
    twice its forward's), and the elementwise work at the measured seconds per byte the forward saves
    for backward (``constants``'s "activation"; constants measured before it: none)."""
    block_ops, head_ops = _op_counts(model.n_heads)
    ops = layers * (block_ops + mode_ops(cfg)) + (head_ops if head else 0)
    overhead = ops * consts.get("dispatch", {}).get("op_seconds", 0.0)
    return (_matmuls(model, cfg, consts, tokens, layers, head) + overhead
            + _saved(model, cfg, consts, tokens, layers, head))


def _matmuls(model, cfg, consts, tokens: int, layers: int, head: bool, attention: bool = True) -> float:
    """Seconds of a forward's matmul FLOPs on this rank: ``layers`` blocks (their attention products too
    unless ``attention`` is False) and the head, this rank's tokens (attention reaches the whole sequence,
    split over sp too), split over tp, at the measured rate."""
    lin, att, head_flops = flops_per_token(model)
    tok = tokens / cfg.sp
    flops = layers * tok * (lin + (att / cfg.sp if attention else 0)) + (tok * head_flops if head else 0)
    return flops / cfg.tp / consts["matmul"]["flops_per_s"]


def _saved(model, cfg, consts, tokens: int, layers: int, head: bool) -> float:
    """A third of the elementwise seconds of a forward and backward: the bytes this rank's forward saves
    (``activation_bytes``: its tokens, the tensor split) at the measured seconds per byte."""
    per_byte = consts.get("activation", {}).get("seconds_per_byte", 0.0)
    if not per_byte:
        return 0.0
    split = cfg.tp if cfg.tp_mode == "1d" else 1  # 2D / 2.5D / 3D split every activation over tp
    a = activation_bytes(model, max(1, tokens // model.seq_len), seq=model.seq_len // cfg.sp, layers=layers,
                         first=head, last=head, tp=split, sequence_split=cfg.tp if cfg.sp_mode == "split_gather" else 1)
    held = a["held"] // (1 if cfg.tp_mode == "1d" else cfg.tp)
    return held * per_byte / 3


def _weight_grads(model, cfg, consts, tokens: int, layers: int) -> float:
    """Seconds of a zero-bubble W on ``layers`` blocks (``tensor.zero_bubble``): each Linear's deferred
    ``dW = g^T x`` (its forward's FLOPs again), ``db = sum g`` and the two accumulations, 4 ops a Linear.
    The rest of a backward is I. Where FLOPs dominate that is about a forward (the zero-bubble paper's
    I = W = F); where the ops do, W is the small part and fills little of the bubble."""
    return (_matmuls(model, cfg, consts, tokens, layers, False, attention=False)
            + layers * 16 * consts.get("dispatch", {}).get("op_seconds", 0.0))


def _recomputed(model, cfg, consts, tokens: int, layers: int) -> float:
    """Seconds recomputation adds to one microbatch of ``layers`` blocks (0 without it).

    "full": their forward's FLOPs again, and per op of their forward the measured cost of recomputing it
    (``constants``'s "recompute": the checkpoint's hooks both ways around the forward run again, 2-3 times an
    op's own cost on CPU; constants measured before it: one forward's ops). "selective": attention's core
    again (``colab_kit.recompute.selective``): its two products' FLOPs (``4 t h`` a token, over sp and tp) and
    its bytes, the core's few ops (the fused kernel and the checkpoint's hold: 4 a block) at that cost, and
    no collective (Ulysses recomputes between its all-to-alls; the ring recomputes nothing more). "op"
    (torchtitan's per-op selective, ``colab_kit.recompute.op``): every second matmul of the block's forward
    (a GPT's proj and fc2: ``(h^2 + h f) / (4 h^2 + 2 h f)`` of its weight FLOPs, 5/12 at f = 4h) and every op
    but the matmuls and the attention kernel, at the recompute cost per op."""
    per_op = consts.get("recompute", consts.get("dispatch", {})).get("op_seconds", 0.0)
    if cfg.recompute == "selective":
        if cfg.sp > 1 and cfg.sp_mode == "ring":
            return 0.0
        core = _matmuls(model, cfg, consts, tokens, layers, False) - _matmuls(model, cfg, consts, tokens, layers,
                                                                              False, attention=False)
        per_byte = consts.get("activation", {}).get("seconds_per_byte", 0.0)
        lse = 4 * tokens // cfg.sp * model.n_heads // cfg.tp  # what the core saved: its log-sum-exp
        return core + layers * (4 * per_op + lse * per_byte / 3)
    if cfg.recompute == "op":
        h, f = model.d_model, model.d_ff or 4 * model.d_model
        share = (h * h + h * f) / (4 * h * h + 2 * h * f)
        block_ops, _ = _op_counts(model.n_heads)
        return (share * _matmuls(model, cfg, consts, tokens, layers, False, attention=False)
                + layers * max(0, block_ops - 5) * per_op)
    if cfg.recompute != "full":
        return 0.0
    block_ops, _ = _op_counts(model.n_heads)
    return (_matmuls(model, cfg, consts, tokens, layers, False) + layers * (block_ops + mode_ops(cfg)) * per_op
            + _saved(model, cfg, consts, tokens, layers, False))


def mode_ops(cfg) -> int:
    """Ops a block's forward runs on top of the dense block's in ``cfg``'s layers, counted from
    their source: ring attention (``sequence.ring``) replaces one fused attention call by 2 sp + 1
    causal chunk pairs per rank (zigzag), each a block forward (scores, mask, log-sum-exp,
    exp, matmul: about 9 ops) merged into the running result (``merge_lse``: about 8); Ulysses
    its two all-to-alls with the stacking and reshapes around them (6); 1D one autograd collective per Linear (4),
    split_gather two (8); SUMMA (2D, 2.5D) q steps of two broadcasts, a matmul and an add per
    Linear (16 q) and LayerNorm2D's explicit statistics (about 9 ops each instead of one); 3D two
    all-gathers and a reduce-scatter per Linear (12) and LayerNorm3D's statistics. A zero-bubble
    schedule (zb-h1, zb-v) runs each Linear as an autograd function that keeps its input for a later W
    (``tensor.zero_bubble``): measured in one process on 2 blocks, F + I + W took 0.9 forwards more
    than F + B, about 12 ops a Linear over a step, so 16 a block here (a forward's ops count 3 times)."""
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
    if cfg.pp > 1 and cfg.schedule in ("zb-h1", "zb-v"):
        extra += 16
    return extra


@functools.lru_cache(maxsize=64)
def _op_counts(heads: int) -> tuple[int, int]:
    """Autograd ops of one block and of the embeddings + ln_f + head + loss (a tiny GPT of the
    same structure, counted once: the count does not depend on the sizes)."""
    import torch
    import torch.nn.functional as F

    g = GPTConfig(vocab_size=8, seq_len=4, d_model=2 * heads, n_heads=heads, n_layers=1)
    model, x = GPT(g), torch.zeros(1, 4, dtype=torch.long)
    whole = count_ops(lambda: F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
    block = count_ops(lambda: model.blocks[0](torch.zeros(1, 4, 2 * heads, requires_grad=True)).sum()) - 1
    return block, whole - block


def step_seconds(model, cfg, batch: int, consts: dict, memory: dict,
                 optimizer: str = "adamw", grad_scale: float = 1.0) -> tuple[float, dict, dict]:
    """(seconds, breakdown by part, collectives per step by part) of one train_step of ``cfg``. ``grad_scale``:
    the parameters whose gradients the rank reduces over ``model``'s own (a mixture of experts priced as its
    active GPT: ``planner.moe.local``)."""
    e = PRECISION_BYTES[cfg.precision]
    m = cfg.microbatches
    tokens = batch // (cfg.dp * m) * model.seq_len
    n_stages = cfg.pp * cfg.chunks
    layers_stage = model.n_layers // n_stages
    layers_rank = layers_stage * cfg.chunks
    parts, counts = {}, {}
    # recomputation (per microbatch): the blocks' forward again and the checkpoint's hooks, and the
    # collectives of the forward it runs again (1D: the attention's, not fc2's, where it stops)
    fwd_share = forward_share(cfg)
    again = (0.5 if cfg.tp_mode == "1d" else 1.0) * fwd_share[0], fwd_share[1]
    if cfg.pp == 1:
        fwd = _forward(model, cfg, consts, tokens, model.n_layers, True)
        rc = _recomputed(model, cfg, consts, tokens, model.n_layers)
        parts["compute"] = m * (3 * fwd + rc)
    else:
        fwd = _forward(model, cfg, consts, tokens, layers_stage, False)
        rc = _recomputed(model, cfg, consts, tokens, layers_stage)
        model_key = (type(model), tuple(dataclasses.asdict(model).items()))
        head = _forward(model, cfg, consts, tokens, 0, True)  # embeddings, ln_f, head and loss: one forward
        slots = m * cfg.chunks  # each rank runs one F and one B (or I and W) per microbatch and chunk
        parts["compute"] = slots * (3 * fwd + rc) + 3 * m * head
        # the rates are measured with every rank busy; a rank's own speed is ``share`` of them faster where
        # ranks share cores (pipeline_cost.bubble); a stage's tp and sp collectives lengthen the slots that
        # run them (F, and B or I; not W), the fill and drain slots too
        share = min(1.0, consts.get("cores", cfg.world_size) / cfg.world_size)
        tp1, _ = tp_comm(model, cfg, consts, tokens, layers_stage, False, e)
        sp1, _ = sp_comm(model, cfg, consts, tokens, layers_stage, e)
        c_fwd = tp1 * fwd_share[0] + sp1 * fwd_share[1]
        c_bwd = tp1 * (1 - fwd_share[0]) + sp1 * (1 - fwd_share[1])
        c_rc = (tp1 * again[0] + sp1 * again[1]) if cfg.recompute == "full" else 0.0
        act = tokens // cfg.sp * model.d_model * e // (cfg.tp if cfg.tp_mode != "1d" else 1)
        alpha, beta = alpha_beta(consts, "send", 2)
        parts["bubble"] = bubble(cfg, model_key, fwd * share, rc * share, c_fwd, c_bwd + c_rc, head * share,
                                 consts.get("cores", cfg.world_size), alpha + act / beta,
                                 _weight_grads(model, cfg, consts, tokens, layers_stage) * share,
                                 bool(consts.get("bound")))
        sends = 2 * m * cfg.chunks
        # every message's latency is work its rank does (on CPU ranks the send and the receive's wake-up
        # cost as much as the half round trip the constants measure); on shared cores it also lies on the
        # path from stage to stage (pipeline_cost.bubble)
        parts["comm:pp"] = sends * (alpha + act / beta)
        counts[Axis.PP] = sends
    tp_s, tp_n = tp_comm(model, cfg, consts, tokens, layers_rank, True, e)  # the head's rank is the slowest
    sp_s, sp_n = sp_comm(model, cfg, consts, tokens, layers_rank, e)
    if cfg.recompute == "full":  # the blocks' forward collectives again (selective repeats none)
        tp_b, tp_bn = tp_comm(model, cfg, consts, tokens, layers_rank, False, e)
        tp_s, tp_n = tp_s + again[0] * tp_b, tp_n + round(again[0] * tp_bn)
        sp_s, sp_n = sp_s * (1 + again[1]), sp_n + round(again[1] * sp_n)
    parts["comm:tp"], counts[Axis.TP] = m * tp_s, m * tp_n
    parts["comm:sp"], counts[Axis.SP] = m * sp_s, m * sp_n
    block_rc = rc / (layers_stage if cfg.pp > 1 else model.n_layers)
    dp_s, dp_n = dp_comm(model, cfg, consts, memory, _forward(model, cfg, consts, tokens, 1, False), block_rc,
                         grad_scale)
    parts["comm:dp"], counts[Axis.DP] = dp_s, dp_n
    parts["optimizer"] = _optimizer(cfg, consts, memory, model, optimizer)
    loss = sum(collective_seconds(consts, "all_reduce", 4, n) for n in (cfg.dp, cfg.sp, cfg.tp, cfg.pp))
    parts["comm:loss"] = loss
    parts = {k: v for k, v in parts.items() if v > 0}
    return sum(parts.values()), parts, {k: v for k, v in counts.items() if v}


OPS_PER_TENSOR = {"adamw": 10, "adam": 10, "sgd-momentum": 3, "sgd": 3, "sgd-nomomentum": 1}
"""Ops torch's optimizers dispatch per tensor they step (counted on CPU, torch 2.13: AdamW 532 for 53 tensors)."""


def stepped_tensors(model, cfg, shared_cores: bool = False) -> int:
    """Tensors the optimizer steps on the fullest rank: a GPT's own (12 a block, the token and position
    tables, the final norm and the head) without ZeRO; one flat piece per gradient bucket at stages 1-2;
    one per chunk at stage 3 (each block, the embeddings, the tail)."""
    if cfg.zero == 3:
        return model.n_layers // cfg.pp + 2
    if cfg.zero in (1, 2):
        return engine_buckets(model, cfg, shared_cores)[1]
    layers = model.n_layers // cfg.pp
    return 12 * layers + (5 if cfg.pp == 1 else 3)  # tables (2) on the first stage, norm + head (3) on the last


def _optimizer(cfg, consts, memory, model=None, optimizer: str = "adamw") -> float:
    """Seconds of the optimizer's step on this rank: its ops (``OPS_PER_TENSOR`` per stepped tensor) at the
    measured seconds per optimizer op, and its elements (the parameters it steps: this rank's shard at
    ZeRO 1/2; the fp32 masters of 16-bit parameters) at the measured seconds per element of AdamW's step
    (``constants``'s "element_seconds": its ~10 passes over each tensor), in proportion for an optimizer of
    fewer ops a tensor. Constants without that figure (older ones, a hardware preset, where the step is one
    fused kernel) price the elements as one read and write of params, grads and states at the memory rate.
    Worked example (the 4-block test GPT, 210,304 parameters in 53 tensors, AdamW, 4 ranks on 2 cores at
    6.2 us an op and 10.8 ns an element): 53 x 10 x 6.2 us + 210,304 x 10.8 ns = 3.3 + 2.3 = 5.6 ms (it
    took 5.1-5.4 ms between forward-backward passes, by hand, once)."""
    shard, ops = cfg.zero_ranks if cfg.zero in (1, 2) else 1, OPS_PER_TENSOR.get(optimizer, 10)
    opt = consts.get("optimizer", {})
    per_element = opt.get("element_seconds")
    if per_element is not None:
        elements = memory["params"] / PRECISION_BYTES[cfg.precision] / shard
        seconds = elements * per_element * ops / OPS_PER_TENSOR["adamw"]
    else:
        touched = memory["params"] // shard + memory["grads"] + memory["optimizer"]
        seconds = 2 * touched / consts["memory"]["bytes_per_s"]
    if cfg.offload == "cpu":
        seconds += 2 * memory["grads"] / consts["memory"]["bytes_per_s"]
    per_op = opt.get("op_seconds", 0.0)  # constants measured before it: bytes only
    if model is not None and per_op:
        seconds += stepped_tensors(model, cfg, shares_cores(consts, cfg)) * ops * per_op
    return seconds

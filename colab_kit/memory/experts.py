"""Memory per rank of a mixture-of-experts GPT under expert parallelism: the estimate ``config_estimate`` gives
for a ``GPTConfig(n_experts=E, ...)`` (so ``engine.memory_estimate()`` and ``ck.plan`` count the experts).

A rank of ``ParallelConfig(dp, tp, pp, sp, ep, zero)`` (tp 1D only, dropless layers only under sp:
``engine.core.unsupported``) holds:

- **dense** parameters (embeddings, attention, LayerNorms, the dense MLPs, each MoE layer's router and shared
  experts): the pipeline stage's, ZeRO-sharded over ``dp`` as a dense model's (``model_state_bytes``). Under
  1D tp the attention and the dense MLPs are split as a dense model's (``part_params``); an MoE layer's router
  and shared experts are not: the MoE layer runs whole on every tp rank;
- **expert** parameters: ``E / ep`` experts of each MoE layer of the stage, whole on every tp rank (tp does not
  divide them), ZeRO-sharded over the expert-data-parallel group, ``edp = dp sp / ep`` ranks
  (``colab_kit.zero.split``): stage 1 the optimizer states, stage 2 the gradients too;
- **activations**: the dense GPT's count in the config's layout (``layout_activations``: 1D tp splits
  attention and the MLP's inner activations, sp keeps ``seq / sp`` tokens of each row) with each MoE block's
  MLP terms replaced by what the MoE layer saves for backward. N is the rank's tokens of the microbatch: under
  tp all of its (dp, sp) shard's (every tp rank routes the same tokens), under sp ``rows x seq / sp``;
  e bytes a value, k = top_k, f = d_expert, S = the shared experts' width, the rows received ``R = N k``
  (balanced routing)::

      router probabilities              e N E
      dispatch buffers (held)           e R h (the rows an expert receives: its GEMM's input)
                                        + e N k h (the rows combined back in their slots, which the
                                        weighting keeps; ``models.experts.combine`` gathers them)
      expert hidden (GELU in, out)      2 e R f
      shared experts (GELU in, out)     2 e N S
      routing indices and weights       24 N k + 2 e N k + e N
      (the dense MLP's 2 e N f / tp is gone; the MLP input e N h is the router's)

  under per-op recomputation only the router's logits ``e N E`` and a shared expert's second matmul's
  output ``e N h`` stay, against the dense block's fc1 ``e N f / tp`` (``moe_block_extra``)

Worked example, 4 experts of width 32 (d_model 32, 2 blocks, both MoE, one shared expert), ``dp=4 ep=2
zero=1``, AdamW, fp32: a rank holds 2 of the 4 experts of each layer, ``2 x 2 x 2,112 = 8,448`` expert
parameters, their optimizer states over ``edp = 2`` ranks::

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.models import GPTConfig
    >>> g = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2,
    ...               d_expert=32, shared_experts=1)
    >>> moe_stage_params(g, ParallelConfig(dp=4, ep=2, zero=1))
    [(17856, 8448)]
    >>> e = moe_estimate(g, ParallelConfig(dp=4, ep=2, zero=1), 8)
    >>> e["params"], e["optimizer"]    # 4 x (17,856 + 8,448); 8 x (17,856 / 4 + 8,448 / 2)
    (105216, 69504)

The same model at ``dp=2 tp=2 ep=2``: attention, embeddings and head halved (17,856 -> 11,616 dense parameters:
``3 h h + 3 h`` and ``h h`` of each block and the ``V h`` of the token table and head split, the router, the
shared expert and the LayerNorms whole), the 2 of 4 experts of each layer whole, ``2 x 2 x 2,112`` again::

    >>> moe_stage_params(g, ParallelConfig(dp=2, tp=2, ep=2))
    [(11616, 8448)]
"""
from __future__ import annotations

from ..models.moe import moe_blocks
from ..pipeline.stage import stage_layers
from .layout import layout_activations, part_params, stage_plan, walks
from .formulas import PRECISION_BYTES, model_state_bytes, placed, recompute_mode
from .saves import BlockSaves

__all__ = ["expert_params", "moe_block_params", "moe_stage_params", "moe_block_extra", "moe_estimate"]


def expert_params(model) -> int:
    """One expert's parameters: ``w_in [d, f]``, ``b_in [f]``, ``w_out [f, d]``, ``b_out [d]``."""
    h, f = model.d_model, model.d_expert or model.d_ff or 4 * model.d_model
    return 2 * h * f + f + h


def moe_block_params(model, tp: int = 1) -> int:
    """Dense parameters of one MoE block (no routed expert) on a rank of 1D tp degree ``tp``: attention (split
    over tp as ``part_params`` splits it), LayerNorms, router ``E x h`` and the shared experts' MLP
    (``2 h S + S + h``, S = ``shared_experts * d_expert``), these last whole on every tp rank."""
    h, f = model.d_model, model.d_ff or 4 * model.d_model
    attention = 4 * h + (3 * h * h + 3 * h) // tp + (h * h) // tp + h  # LayerNorms, qkv, proj (bias whole)
    s = model.shared_experts * (model.d_expert or f)
    return attention + model.n_experts * h + ((2 * h * s + s + h) if s else 0)


def _moe_layers() -> tuple:
    return moe_blocks, stage_layers


def moe_stage_params(model, config) -> list[tuple[int, int]]:
    """``(dense, experts)`` parameters each pipeline rank holds (before ZeRO): the stage's blocks (dense or
    MoE), the embeddings on the first stage, ``ln_f`` and the head on the last, split by 1D tp as a dense
    model's but for the MoE layers' router and shared experts; ``E / ep`` experts per MoE layer, whole on every
    tp rank."""
    moe_blocks, stage_layers = _moe_layers()
    parts = part_params(model, config)
    moe = set(moe_blocks(model))
    local = model.n_experts // config.ep * expert_params(model)
    n = config.pp * config.chunks
    layers = stage_layers(model.n_layers, n)

    def stage(s):
        dense = sum(moe_block_params(model, config.tp) if i in moe else parts["block"] for i in layers[s])
        dense += parts["embed"] * (s == 0) + parts["tail"] * (s == n - 1)
        return dense, local * sum(i in moe for i in layers[s])
    if config.pp == 1:
        return [stage(0)]
    plan, _ = stage_plan(config)
    out = []
    for r in range(config.pp):
        held = [stage(s) for s in plan.stages_of(r)]
        out.append((sum(d for d, _ in held), sum(x for _, x in held)))
    return out


def moe_block_extra(model, tokens: int, e: int, recompute="none", tp: int = 1, op_exact: bool = True,
                    dense_mlp: int | None = None, layer=None) -> int:
    """Bytes one MoE block saves beyond (or below) a dense block of the same widths for ``tokens`` tokens on
    the rank (the module docstring's table: under 1D tp the MoE layer's terms whole, the dense MLP's
    ``2 e N f / tp`` it replaces split); 0 under full recomputation (a block keeps its input only). Per-op
    (``recompute.op``: every second matmul kept) keeps the router's logits (the block's third matmul) and, with
    shared experts, their second matmul's output, ``e N E + e N h``, where a dense block keeps fc1's ``e N f / tp``;
    the routed experts' grouped GEMMs are not counted matmuls, so the dispatch and the experts run again.
    ``op_exact`` False (a block whose matmul order is not the MoE GPT's: ``memory.moe_shape.op_keeps_router``):
    per-op is counted as no recomputation of the MoE layer, an upper bound. ``dense_mlp``: what the dense block's
    MLP keeps in this mode where it is not the GPT's (``BlockSaves.mlp_bytes``: a gated MLP's four inner tensors;
    under per-op its kept matmuls' outputs). ``layer``: what a Hugging Face MoE layer saves, traced off the layer
    (``memory.moe_saves.MoELayerSaves``), in place of the MoE GPT's table where nothing is recomputed (or only
    attention's core), and under per-op where it was traced under the policy too (``layer.op``; then
    ``op_exact`` is not read)."""
    mode = recompute_mode(recompute)
    if mode == "full":
        return 0
    n, h, k = tokens, model.d_model, model.top_k
    f, fe = model.d_ff or 4 * h, model.d_expert or model.d_ff or 4 * h
    if mode == "op" and layer is not None and layer.op:
        return layer.bytes(n, e, "op") - (e * n * f // tp if dense_mlp is None else dense_mlp)
    if mode == "op" and op_exact:
        dense = e * n * f // tp if dense_mlp is None else dense_mlp
        return e * n * model.n_experts + (e * n * h if model.shared_experts else 0) - dense
    dense = 2 * e * n * f // tp if dense_mlp is None else dense_mlp  # what the layout counted for the dense MLP
    if layer is not None:
        return layer.bytes(n, e) - dense
    s = model.shared_experts * fe
    rows = n * k  # received by this rank's experts on average (balanced routing)
    dispatch = e * rows * h + e * n * k * h
    return (e * n * model.n_experts + dispatch + 2 * e * rows * fe + 2 * e * n * s
            + 24 * n * k + 2 * e * n * k + e * n - dense)


def _stage_activations(model, config, rows: int, seq: int, layers, first: bool, last: bool, moe: set,
                       op_exact: bool = True, saves=None, layer=None) -> int:
    """One microbatch's saved bytes on a stage: the dense GPT's in the config's layout (1D tp, sp's
    ``seq / sp`` tokens) and each MoE block's difference for the rank's ``rows x seq / sp`` tokens."""
    e = PRECISION_BYTES[config.precision]
    dense = layout_activations(model, config, rows, seq, layers=len(layers), first=first, last=last, saves=saves)
    tokens = rows * (seq // config.sp)
    mlp = saves.mlp_bytes(tokens, e, config.tp, recompute_mode(config.recompute)) if saves is not None else None
    extra = moe_block_extra(model, tokens, e, config.recompute, config.tp, op_exact, mlp, layer)
    if layer is not None and layer.ep_kept and config.ep > 1 and recompute_mode(config.recompute) == "op":
        extra += e * tokens * model.top_k * layer.ep_kept  # the engine's expert loop: one output an expert kept
    return dense + sum(i in moe for i in layers) * extra


def moe_block_store(model, n: int, e: int, tp: int, saves=None, shared_ffn: int | None = None,
                    router_linear: bool = True) -> int:
    """What a zero-bubble I leaves for its W in one MoE block (``BlockSaves.store``'s rule: each Linear split by
    ``use_split_backward`` keeps its input and output gradient): attention's as a dense block's; the router where
    it is an ``nn.Linear`` (``router_linear``: the MoE GPT's, its input and its ``E``-wide gradient; a Hugging Face
    router is a module of its own, whose weight gradient comes in I); the shared experts' MLP of width ``S`` (the
    MLP's input, the inner input of its last Linear, the gradients: ``S + h``, gated ``2 S + h``), whole on every
    tp rank. The routed experts run as grouped GEMMs: their weight gradients come in I too.

        >>> from colab_kit.models import GPTConfig
        >>> g = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2,
        ...               d_expert=32, shared_experts=1)
        >>> moe_block_store(g, 10, 4, 1)  # 4 x 10 x (attention 2h in, 4h out + the MLP's input h + router 4 + S, S, h)
        12960
    """
    s = saves or BlockSaves.of_gpt(model)
    mm = s.matmuls()
    attention = mm[:len(mm) - (3 if s.gated else 2)]
    h = s.hidden
    width = (model.shared_experts * (model.d_expert or model.d_ff or 4 * h)) if shared_ffn is None else shared_ffn
    out = e * n * (h + s.q // tp) + e * n * sum(w // tp if split else w for w, split in attention)
    if router_linear or width:
        out += e * n * h  # the MLP's input, the router's and the shared experts' first Linears'
    if router_linear:
        out += e * n * model.n_experts
    if width:
        out += e * n * (width + (2 * width if s.gated else width) + h)
    return out


def _stage_store(model, config, rows: int, seq: int, layers, last: bool, moe: set, saves, shared_ffn,
                 router_linear: bool) -> int:
    """A stage's zero-bubble weight store: dense blocks as ``BlockSaves.store``, MoE blocks ``moe_block_store``."""
    e, n = PRECISION_BYTES[config.precision], rows * (seq // config.sp)
    s = saves or BlockSaves.of_gpt(model)
    dense = sum(i not in moe for i in layers)
    return (s.store(n, e, config.tp, dense, last)
            + sum(i in moe for i in layers) * moe_block_store(model, n, e, config.tp, s, shared_ffn, router_linear))


def moe_estimate(model, config, batch: int, optimizer="adamw", *, seq: int | None = None,
                 pp_rank: int | None = None, host_share: float | None = None, moe=None, split=None,
                 params=None, op_exact: bool = True, saves=None, layer=None, shared_ffn: int | None = None,
                 router_linear: bool = True) -> dict:
    """``config_estimate`` for an MoE GPT (``model.n_experts > 0``): the keys of ``engine.memory()`` with
    "device" and "host" for pipeline rank ``pp_rank`` (None: the fullest). See the module docstring.

    The planner prices other models through the same walk: ``moe`` the MoE block indices (default
    ``moe_blocks(model)``), ``split`` each stage's block range (default ``stage_layers``), ``params`` each pipeline
    rank's ``(dense, experts)`` parameters (default ``moe_stage_params``), ``op_exact`` whether its blocks run
    their matmuls in the MoE GPT's order (``moe_block_extra``), ``saves`` what its blocks save outside the MoE layer
    (``memory.saves.BlockSaves``: a Hugging Face model's RMSNorm, attention widths, rotary tables; the GPT's when
    None), ``layer`` what its MoE layers save (``memory.moe_saves.MoELayerSaves``; the MoE GPT's table when None);
    ``shared_ffn`` and ``router_linear`` what a zero-bubble schedule's weight store keeps (``moe_block_store``)."""
    import numpy as np

    moe_blocks, stage_layers = _moe_layers()
    seq = model.seq_len if seq is None else seq
    rows = batch // (config.dp * config.microbatches)
    edp = config.zero_ranks // config.ep  # ep 1: the experts are dense, over dp x sp with the rest
    n = config.pp * config.chunks
    layers = split or stage_layers(model.n_layers, n)
    moe = set(moe_blocks(model) if moe is None else moe)
    per = [_stage_activations(model, config, rows, seq, layers[s], s == 0, s == n - 1, moe, op_exact, saves, layer)
           for s in range(n)]
    if config.pp > 1:
        plan, _ = stage_plan(config)
        acts = []
        store = [_stage_store(model, config, rows, seq, layers[s], s == n - 1, moe, saves, shared_ffn, router_linear)
                 for s in range(n)] if config.schedule.startswith("zb") else [0] * n
        for stages, counts in walks(plan):  # F adds a stage's activations, I trades them for its weight store
            values = np.array([per[s] for s in stages] + [store[s] for s in stages], dtype=np.int64)
            acts.append(int((counts @ values).max()))
    else:
        acts = [per[0]]
    states = []
    for dense, experts in (params or moe_stage_params(model, config)):
        d = model_state_bytes(dense, optimizer, config.precision, config.zero_ranks, config.zero, config.offload)
        x = model_state_bytes(experts, optimizer, config.precision, edp, config.zero, config.offload)
        states.append({k: d[k] + x[k] for k in d})
    totals = [sum(s.values()) + a for s, a in zip(states, acts)]
    r = max(range(config.pp), key=totals.__getitem__) if pp_rank is None else pp_rank
    return placed({**states[r], "activations": acts[r]}, config.zero, config.offload, host_share)

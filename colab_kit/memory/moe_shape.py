"""``ModelShape`` of a mixture of experts: the built-in MoE GPT from its config, a Hugging Face MoE model read on
the meta device (Mixtral, Qwen3-MoE, DeepSeek-V3, ...: any causal LM whose blocks' MLP holds stacked expert
tensors ``mlp.experts.*`` of first dim E, the layout transformers 5 gives them).

What is read: the blocks whose MLP has experts (the others are dense), E from the stacked tensors, top-k from
the config (``num_experts_per_tok``), one expert's width from its parameters (gated: ``3 h f``), the shared
experts' width (``mlp.shared_experts`` / ``mlp.shared_expert``), the attention's matrices as they are (DeepSeek's
multi-head latent attention, Qwen3's head_dim), and the exact parameter count. Total and active parameters
then follow (``ModelShape.params``, ``ModelShape.active_params``).

Worked example, DeepSeek-V3 as its technical report gives it (arXiv 2412.19437, Sec. 4.2: 61 layers, the first
3 dense, 256 routed experts of width 2,048 and 1 shared, top-8, hidden 7,168, 128 heads, MLA; 671B total, 37B
active, of which the multi-token-prediction module's 14B are not in transformers' model)::

    >>> from transformers import DeepseekV3Config                                  # doctest: +SKIP
    >>> s = ModelShape.of(DeepseekV3Config(...published sizes...))                 # doctest: +SKIP
    >>> round(s.params / 1e9, 1), round(s.active_params / 1e9, 1), len(s.moe_blocks)  # doctest: +SKIP
    (671.0, 37.5, 58)
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..config import ConfigError
from ..models import GPTConfig
from ..models.hf_moe import aux_coef
from ..models.moe import moe_blocks
from ..policy import policy_for
from .experts import moe_estimate
from .layout import stage_plan
from .moe_saves import trace_moe_layer
from .saves import qk_norm, rms_kind

__all__ = ["gpt_moe_of", "gpt_moe_shape", "hf_experts", "hf_moe_shape", "moe_memory", "op_keeps_router", "stage_split",
           "tp_layer_params"]


def gpt_moe_shape(cls, cfg, seq: int | None):
    """The ``ModelShape`` of a built-in ``GPTConfig(n_experts=E, ...)`` (GELU experts with biases)."""
    f = cfg.d_ff or 4 * cfg.d_model
    return cls(layers=cfg.n_layers, hidden=cfg.d_model, heads=cfg.n_heads, vocab=cfg.vocab_size,
               seq=seq or cfg.seq_len, ffn=f, name="GPT-MoE", experts=cfg.n_experts, top_k=cfg.top_k,
               d_expert=cfg.d_expert or f, shared_ffn=cfg.shared_experts * (cfg.d_expert or f),
               moe_blocks=tuple(moe_blocks(cfg)), drops=cfg.capacity_factor is not None)


def _blocks(model: nn.Module) -> list:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _moe_mlp(block: nn.Module):
    """The block's MLP when it holds stacked experts (parameters of 3 dims), else None."""
    for name in ("mlp", "block_sparse_moe"):
        mlp = getattr(block, name, None)
        experts = getattr(mlp, "experts", None)
        if isinstance(experts, nn.Module) and any(p.dim() == 3 for p in experts.parameters(recurse=False)):
            return mlp
    return None


def hf_experts(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM with MoE blocks this module reads: its ``config`` (top-k, widths)
    and blocks ``model.layers[i].mlp.experts`` of stacked tensors. A user's model laid out the same way without a
    config is not one (it is read through its policy, as a dense model)."""
    return getattr(model, "config", None) is not None and any(_moe_mlp(b) is not None for b in _blocks(model))


def _matrices(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def hf_moe_shape(cls, model: nn.Module, seq: int | None):
    """The ``ModelShape`` of a Hugging Face MoE causal LM (on the meta device: nothing allocated)."""
    cfg: Any = model.config
    blocks = _blocks(model)
    moe = [i for i, b in enumerate(blocks) if _moe_mlp(b) is not None]
    h = int(cfg.hidden_size)
    mlp: Any = _moe_mlp(blocks[moe[0]])
    stacked = [p for p in mlp.experts.parameters(recurse=False) if p.dim() == 3]
    n = int(stacked[0].shape[0])
    d_expert = sum(p.numel() for p in stacked) // (n * 3 * h)
    shared = next((getattr(mlp, a) for a in ("shared_experts", "shared_expert") if hasattr(mlp, a)), None)
    dense = next((b.mlp for b in blocks if _moe_mlp(b) is None and hasattr(b, "mlp")), None)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or h // heads)
    qk = int(getattr(cfg, "qk_head_dim", None) or head_dim)
    v = int(getattr(cfg, "v_head_dim", None) or head_dim)
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    max_seq = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if not top_k or not (seq or max_seq):
        raise ConfigError(f"ck.estimate reads a mixture of experts' top-k from config.num_experts_per_tok and its "
                          f"sequence from max_position_embeddings; {type(model).__name__} has top-k {top_k!r}, "
                          f"sequence {max_seq!r}: pass seq= and a config with num_experts_per_tok (e.g. 8)")
    core = heads * (qk + v) // 2
    return cls(layers=len(blocks), hidden=h, heads=heads, vocab=int(cfg.vocab_size), seq=seq or max_seq,
               ffn=(_matrices(dense) // (3 * h)) if dense is not None else d_expert,
               kv_heads=int(getattr(cfg, "num_key_value_heads", 0) or 0), gated=True,
               tied=bool(getattr(cfg, "tie_word_embeddings", False)), positions=False, name=type(model).__name__,
               params_exact=sum(p.numel() for p in model.parameters()), experts=n, top_k=top_k,
               d_expert=d_expert, shared_ffn=_matrices(shared) // (3 * h), moe_blocks=tuple(moe),
               attn_params=_matrices(getattr(blocks[0], "self_attn", None)), core_width=0 if core == h else core,
               qk_norm=qk_norm(blocks[0], head_dim), norm=rms_kind(blocks[0], h), latent=_latent(cfg),
               sinks=getattr(getattr(blocks[0], "self_attn", None), "sinks", None) is not None,
               linears=_linears(model, blocks, set(moe), h, d_expert), block_counts=_block_counts(model, blocks),
               moe_saves=_traced(mlp, h, n, aux_coef(model) > 0, _before(blocks, moe)))


def _before(blocks: list, moe: list) -> int | None:
    """The matmuls each MoE block runs ahead of its MoE layer (its attention's Linears), where every MoE block runs
    the same number and some: one trace serves them all. None otherwise (a block without attention Linears, or
    blocks that differ): per-op recomputation by the walk's rule (``op_keeps_router``)."""
    counts = {len(_attention_linears(blocks[i])) for i in moe}
    return counts.pop() if len(counts) == 1 and 0 not in counts else None


def _attention_linears(block: nn.Module) -> list:
    attention = getattr(block, "self_attn", None)
    return [m for m in attention.modules() if isinstance(m, nn.Linear)] if isinstance(attention, nn.Module) else []


def _linears(model: nn.Module, blocks: list, moe: set, hidden: int, d_expert: int) -> tuple:
    """Each matmul of a block in forward order, ``(output width, split over tp)`` (``BlockSaves.linears``, what
    per-op recomputation keeps every second of): attention's Linears as they are (DeepSeek's five latent
    projections), split where the policy makes them columns, then the dense MLP's, a dense block's or, where every
    block is MoE, gate, up and down of the expert width (the MLP the walk counts before an MoE layer replaces it).
    () where the block has no ``self_attn`` Linears: the gated default."""
    attention = _attention_linears(blocks[0])
    if not attention:
        return ()
    policy = policy_for(model)
    columns = {id(m) for _, _, m in policy.modules(model, "column")} if policy is not None else set()
    dense = next((getattr(b, "mlp", None) for i, b in enumerate(blocks) if i not in moe), None)
    mlp = [m for m in dense.modules() if isinstance(m, nn.Linear)] if isinstance(dense, nn.Module) else []
    tail = [(m.out_features, id(m) in columns) for m in mlp] or [(d_expert, True), (d_expert, True), (hidden, False)]
    return tuple((m.out_features, id(m) in columns) for m in attention) + tuple(tail)


def _block_counts(model: nn.Module, blocks: list) -> tuple:
    """``ModelShape.block_counts``: each block's ``(whole, split, routed)`` parameters, split those of the policy's
    column Linears (weight and bias) and row Linears (weight; its bias is added whole after the sum), routed the
    MoE layer's ``experts``."""
    policy = policy_for(model)
    roles = {id(m): r for _, r, m in policy.modules(model)} if policy is not None else {}
    out = []
    for block in blocks:
        mlp = _moe_mlp(block)
        routed = sum(p.numel() for p in mlp.experts.parameters()) if mlp is not None else 0
        split = sum(m.weight.numel() + (m.bias.numel() if roles[id(m)] == "column" and m.bias is not None else 0)
                    for m in block.modules() if roles.get(id(m)) in ("column", "row"))
        out.append((sum(p.numel() for p in block.parameters()) - routed - split, split, routed))
    return tuple(out)


def _traced(mlp, hidden: int, experts: int, aux: bool, before: int | None):
    """The MoE layer traced (``memory.moe_saves``; per-op recomputation after attention's ``before`` matmuls), or
    None where fake tensors cannot run it (transformers' eager experts loop sizes its rows with ``nonzero``): the
    MoE GPT's table then (``memory.experts``)."""
    try:
        return trace_moe_layer(mlp, hidden, experts, aux=aux, before=before)
    except Exception:  # noqa: BLE001  # any failure of the trace: the table, as before the trace
        return None


def _latent(cfg) -> tuple:
    """DeepSeek's multi-head latent attention widths (``BlockSaves.latent``), or ()."""
    if not getattr(cfg, "kv_lora_rank", None):
        return ()
    return (int(getattr(cfg, "q_lora_rank", 0) or 0), int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim),
            int(cfg.qk_nope_head_dim), int(cfg.v_head_dim))


def stage_split(layers: int, stages: int) -> list[range]:
    """Each stage's blocks: the engine's even split, or where ``stages`` does not divide ``layers`` (a layout
    priced, not run: DeepSeek-V3's 61 blocks over 16 stages) ``layers // stages`` each and one more on each of
    the last ``layers % stages`` stages (the fullest stage then also holds the head).

        >>> [len(r) for r in stage_split(61, 16)]
        [3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    """
    base, extra = divmod(layers, stages)
    sizes = [base + (s >= stages - extra) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(a, a + k) for a, k in zip(starts, sizes)]


def gpt_moe_of(shape):
    """The built-in MoE GPT of ``shape``'s widths (a gated MLP as a GELU one 1.5 times as wide; every block MoE:
    ``shape.moe_blocks`` says which are, where it matters)."""
    g = 3 / 2 if shape.gated else 1
    return GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, d_model=shape.hidden, n_heads=shape.heads,
                     n_layers=shape.layers, d_ff=round(shape.d_ff * g), n_experts=shape.experts, top_k=shape.top_k,
                     d_expert=round(shape.d_expert * g), shared_experts=round(shape.shared_ffn / shape.d_expert))


def tp_layer_params(shape, i: int, tp: int) -> tuple[int, int]:
    """``(dense, routed experts)`` parameters of block ``i`` on a rank of 1D tp degree ``tp``: attention's
    matrices (and a GPT's q, k, v biases) split, as are a dense block's MLP (its matrices, a GPT's ``fc1`` bias);
    the norms, a GPT's row-parallel biases and an MoE layer (router, shared experts, routed experts) whole: the
    MoE layer runs whole on every tp rank. ``tp=1``: ``shape.layer_params(i)``. A shape read off a Hugging Face
    model (``block_counts``) splits what its policy splits: its column and row Linears.

        >>> from colab_kit.models import GPTConfig
        >>> from colab_kit.memory.shape import ModelShape
        >>> s = ModelShape.of(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4,
        ...                             top_k=2, d_expert=32, shared_experts=1))
        >>> s.layer_params(0), tp_layer_params(s, 0, 2)  # 3h^2 + 3h + h^2 = 4,192 of the 6,592 halved
        ((6592, 8448), (4496, 8448))
    """
    if shape.block_counts:  # read off the model: its column and row Linears split, the rest whole
        whole, split, routed = shape.block_counts[i]
        return whole + split // tp, routed
    dense, experts = shape.layer_params(i)
    if tp == 1:
        return dense, experts
    h, gpt = shape.hidden, not shape.gated
    attention = shape.attention_params() + (shape.qkv_out if gpt else 0)
    if i in shape.moe_blocks:
        return dense - attention + attention // tp, experts
    mlp = shape.mlp_params(shape.d_ff) - (h if gpt else 0)  # fc2's bias stays whole (row-parallel)
    split = attention + mlp
    return dense - split + split // tp, experts


def moe_memory(shape, config, batch: int, optimizer: str = "adamw", pp_rank: int | None = None) -> dict:
    """The fullest rank's bytes of a mixture of experts ``shape`` under ``config`` (``memory.experts``'s walk; pipeline
    rank ``pp_rank`` where given):
    model states from the shape's own per-block counts (dense over dp, split by 1D tp as ``part_params``
    splits a GPT but for the MoE layers, which run whole on every tp rank; ``E / ep`` experts per MoE block over
    edp, whole on every tp rank: ``tp_layer_params``), activations of its blocks outside the MoE layers as they
    save them (``shape.block_saves()``: norms, attention widths, a gated dense MLP) in the config's layout with
    each MoE block's router, dispatch buffers and
    expert hidden states for the rank's tokens (all of its (dp, sp) shard's under tp, ``seq / sp`` of a row
    under sp)."""
    gpt = gpt_moe_of(shape)
    n = config.pp * config.chunks
    split = stage_split(shape.layers, n)
    h, tp = shape.hidden, config.tp
    embed = shape.vocab // tp * h + (shape.seq * h if shape.positions else 0)
    tail = (h if shape.gated else 2 * h) + (0 if shape.tied and n == 1 else shape.vocab // tp * h)

    def stage(s):
        parts = [tp_layer_params(shape, i, tp) for i in split[s]]
        dense = sum(d for d, _ in parts) + embed * (s == 0) + tail * (s == n - 1)
        return dense, sum(x for _, x in parts) // config.ep
    if n == 1:
        params = [stage(0)]
    else:
        plan, _ = stage_plan(config)
        params = [tuple(map(sum, zip(*[stage(s) for s in plan.stages_of(r)]))) for r in range(config.pp)]
    return moe_estimate(gpt, config, batch, optimizer, seq=shape.seq, moe=shape.moe_blocks, split=split,
                        params=params, op_exact=op_keeps_router(shape), saves=shape.block_saves(),
                        layer=shape.moe_saves, shared_ffn=shape.shared_ffn, router_linear=shape.name == "GPT-MoE",
                        pp_rank=pp_rank)


def op_keeps_router(shape) -> bool:
    """Whether per-op recomputation (``recompute.op``: every second matmul kept) keeps an MoE block's router
    logits and nothing else of its MoE layer, as it does in the built-in MoE GPT (qkv, proj, router: the third;
    a shared expert after it, its second kept). So too where attention is four plain matrices (q, k, v, o: the
    router fifth) and there is no shared expert (Mixtral, Qwen3-MoE). Not where attention has another count
    (DeepSeek's latent attention: five) or a shared expert may run first (Qwen2-MoE): those are estimated as
    keeping the MoE layer's terms, an upper bound. This rule is used only where fake tensors could not trace the
    layer; a traced layer is counted as the policy runs it (``MoELayerSaves.op``).

        >>> from dataclasses import replace
        >>> from colab_kit.memory.shape import ModelShape
        >>> mixtral = ModelShape(layers=2, hidden=64, heads=4, vocab=128, seq=32, kv_heads=2, gated=True,
        ...                      name="MixtralForCausalLM", experts=4, top_k=2, d_expert=32, moe_blocks=(0, 1),
        ...                      attn_params=12288)
        >>> op_keeps_router(mixtral), op_keeps_router(replace(mixtral, shared_ffn=64))
        (True, False)
    """
    if shape.name == "GPT-MoE":
        return True
    if shape.shared_ffn:
        return False
    q = shape.core_width or shape.hidden
    kv = shape.n_kv * (q // shape.heads)
    return shape.attn_params in (0, 2 * shape.hidden * q + 2 * shape.hidden * kv)

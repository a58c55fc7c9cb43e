"""Policies for Hugging Face ``transformers`` models, handed to ``ck.boost`` as they are.

``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (and Llama's kin: ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``LLAMA_LIKE``), built from a config (random weights, no download),
the same on every rank (same seed)::

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4,
                                         n_positions=32, vocab_size=128, resid_pdrop=0, embd_pdrop=0,
                                         attn_pdrop=0))
    engine = ck.boost(model, opt, ck.ParallelConfig(dp=2, tp=2))
    engine.train_step((input_ids, targets))   # mean token CE of model(input_ids).logits

GPT-2. Its ``Conv1D`` layers (``x @ W + b``, ``W [in, out]``) become ``nn.Linear``s first
(``prepare``: the same map, the weight transposed), so every tensor mode lowers them as any
Linear; ``save_pretrained`` transposes them back. ``c_attn`` is ``[q | k | v]`` (all heads of q,
then of k, then of v), which the model's forward splits in three: the policy marks it ``fused``
in 3 parts, so each rank holds ``[q_i | k_i | v_i]`` of whole heads and the attention's
``split_size`` is divided like its heads. The LM head is tied to ``wte``.

Worked example, tp=2 (1d), n_embd=32, 4 heads of 8: rank 0's ``c_attn`` holds output features
0..15 (q of heads 0-1), 32..47 (their k), 64..79 (their v); ``split_size`` 16; ``c_proj`` input
features 0..15. Rank 1 holds heads 2-3 likewise.

Llama. ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` are column Linears,
``o_proj`` and ``down_proj`` row Linears (grouped-query attention: the key/value heads must divide
by the head split too), the RMSNorms ``rmsnorm`` (whole in 1d, statistics over the grid row in
2d), ``rotary_emb`` the rotary role: every pipeline stage keeps it (the policy's ``context`` makes
each block's ``position_embeddings`` from it), and sequence parallelism hands it the global
positions of this rank's tokens. The attention modules reshape with ``-1`` heads, so nothing in
them is divided.

Both call ``transformers``' attention-function registry, so sequence parallelism (ring, Ulysses)
registers its own function there (``Attention(hf=True)``). 3d runs both too (GPT-2's tied head is
``TiedHead3D``, Llama's RMSNorm ``RMSNorm3D``). Dropout (``*_pdrop``, ``attention_dropout``)
trains under every mode through ``colab_kit.models.dropout`` (its attention-probability dropout runs in
transformers' eager attention, registered as ``colab_kit_dropout``; under sp, Ulysses on whole rows, the ring block by
block): to compare with one process, pass the reference through ``ck.models.layout_invariant`` too.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from . import Attention, Policy

__all__ = ["gpt2_policy", "llama_policy", "conv1d_to_linear", "converted_conv1d", "sliding_window", "LLAMA_LIKE",
           "without_kv_cache"]

_CONVERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per prepared GPT-2: the paths of the modules that were ``Conv1D`` (kept here, not on the model)."""


def converted_conv1d(model: nn.Module) -> list[str]:
    """The paths of ``model``'s modules that ``conv1d_to_linear`` turned into ``nn.Linear`` (``save_pretrained``
    turns their weights back), [] for a model it did not prepare."""
    return list(_CONVERTED.get(model, []))


def conv1d_to_linear(model: nn.Module) -> list[str]:
    """Replace every ``transformers`` ``Conv1D`` under ``model`` by the equivalent ``nn.Linear`` (same
    device, the weight transposed); returns their paths (also kept: ``converted_conv1d``). Idempotent."""
    from transformers.pytorch_utils import Conv1D

    done = converted_conv1d(model)
    for path, mod in list(model.named_modules()):
        if not isinstance(mod, Conv1D):
            continue
        w = mod.weight  # [in, out]
        lin = nn.Linear(w.shape[0], w.shape[1], bias=mod.bias is not None, device="meta")
        # built on meta: a view of the Conv1D weight, made from its recipe (colab_kit.sharded_init) when needed
        t = w.detach().t() if w.is_meta else w.detach().t().contiguous()
        lin.weight = nn.Parameter(t, requires_grad=w.requires_grad)
        if mod.bias is not None:
            lin.bias = mod.bias
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, lin)
        done.append(path)
    _CONVERTED[model] = done
    return done


def gpt2_policy(model) -> Policy:
    h = "transformer.h"
    tied = model.lm_head.weight is model.transformer.wte.weight
    return Policy(
        name="hf-gpt2", blocks=h,
        layers={"transformer.wte": "vocab", "transformer.wpe": "positions",
                f"{h}.*.ln_1": "norm", f"{h}.*.attn.c_attn": "column", f"{h}.*.attn.c_proj": "row",
                f"{h}.*.ln_2": "norm", f"{h}.*.mlp.c_fc": "column", f"{h}.*.mlp.c_proj": "row",
                "transformer.ln_f": "norm", "lm_head": "head"},
        attention={f"{h}.*.attn": Attention(heads=("num_heads",), widths=("split_size",), hf=True)},
        fused={f"{h}.*.attn.c_attn": 3},
        tied=(("transformer.wte", "lm_head"),) if tied else (),
        prepare=conv1d_to_linear, output=lambda out: out.logits,
        embed=_gpt2_embed, finish=lambda m, x: m.lm_head(m.transformer.ln_f(x)),
        tail=("transformer.ln_f", "lm_head"), loss="tokens")


def _gpt2_embed(m, ids):
    t = m.transformer
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return t.drop(t.wte(ids) + t.wpe(pos))


def without_kv_cache(model) -> None:
    """Turn a Hugging Face model's KV cache off, as a training step runs it: the step reads no cache, a recomputed
    forward would append its keys a second time, and a cache's copies of each layer's keys and values would be
    saved memory the step never holds (GPT-2: 7% of its activations). The engine does this to the model it trains
    (``engine.parts``), the memory trace to its twin (``memory.fake.saved_bytes``). Nothing for another model.

    >>> import types
    >>> m = types.SimpleNamespace(config=types.SimpleNamespace(use_cache=True)); without_kv_cache(m)
    >>> m.config.use_cache
    False
    """
    hf = getattr(model, "config", None)
    if hf is not None and getattr(hf, "use_cache", False):
        hf.use_cache = False


LLAMA_LIKE = {  # transformers' module:class -> the policy's name: Llama's frame, block and module names
    "transformers.models.llama.modeling_llama:LlamaForCausalLM": "hf-llama",
    "transformers.models.mistral.modeling_mistral:MistralForCausalLM": "hf-mistral",
    "transformers.models.qwen2.modeling_qwen2:Qwen2ForCausalLM": "hf-qwen2",
    "transformers.models.qwen3.modeling_qwen3:Qwen3ForCausalLM": "hf-qwen3",
}
"""The dense causal LMs ``llama_policy`` lowers. Mistral is Llama with a sliding window (``sliding_window``);
Qwen2 adds biases to q, k and v (column Linears split them with their rows); Qwen3 normalises q and k head by
head (``q_norm``, ``k_norm`` of ``head_dim``: whole heads on each rank, so the norms stay whole)."""


def sliding_window(model) -> int | None:
    """The window of a model whose attention looks back a limited number of tokens in some layer (Mistral's
    ``sliding_window``, Qwen's with ``use_sliding_window``), where it is shorter than the positions the model
    takes; None otherwise. Its forward masks that window itself: a sequence or pipeline plan, which calls
    the attention without the model's mask, would attend further back.

    >>> import types
    >>> mistral = types.SimpleNamespace(config=types.SimpleNamespace(sliding_window=4096,
    ...                                 max_position_embeddings=32768))
    >>> qwen2 = types.SimpleNamespace(config=types.SimpleNamespace(sliding_window=4096, use_sliding_window=False,
    ...                               max_position_embeddings=32768, layer_types=["full_attention"] * 2))
    >>> sliding_window(mistral), sliding_window(qwen2)
    (4096, None)
    """
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types_ = getattr(cfg, "layer_types", None)
    if types_ is not None and "sliding_attention" not in types_:
        return None
    longest = getattr(cfg, "max_position_embeddings", None)
    return int(window) if longest is None or int(window) < int(longest) else None


def llama_policy(model) -> Policy:
    """Llama's policy, and that of the models of ``LLAMA_LIKE`` (named after each)."""
    cfg, L = model.config, "model.layers"
    key = f"{type(model).__module__}:{type(model).__qualname__}"
    return Policy(
        name=LLAMA_LIKE.get(key, "hf-llama"), blocks=L,
        layers={"model.embed_tokens": "vocab", "model.rotary_emb": "rotary",
                f"{L}.*.input_layernorm": "rmsnorm", f"{L}.*.self_attn.q_proj": "column",
                f"{L}.*.self_attn.k_proj": "column", f"{L}.*.self_attn.v_proj": "column",
                f"{L}.*.self_attn.o_proj": "row", f"{L}.*.post_attention_layernorm": "rmsnorm",
                f"{L}.*.mlp.gate_proj": "column", f"{L}.*.mlp.up_proj": "column", f"{L}.*.mlp.down_proj": "row",
                "model.norm": "rmsnorm", "lm_head": "head"},
        attention={f"{L}.*.self_attn": Attention(n_heads=cfg.num_attention_heads,
                                                 n_kv_heads=cfg.num_key_value_heads, hf=True)},
        tied=(("model.embed_tokens", "lm_head"),) if model.lm_head.weight is model.model.embed_tokens.weight else (),
        output=lambda out: out.logits, embed=lambda m, ids: m.model.embed_tokens(ids),
        finish=lambda m, x: m.lm_head(m.model.norm(x)), context=_llama_context,
        tail=("model.norm", "lm_head"), everywhere=("model.rotary_emb",), loss="tokens")


def _llama_context(m, ids):
    """What each decoder layer gets beside its input: the rotary ``position_embeddings`` of the positions
    (and the ids of those positions), made on every stage from its microbatch's ids."""
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    like = torch.empty(0, dtype=next(m.parameters()).dtype, device=ids.device)
    return {"position_embeddings": m.model.rotary_emb(like, pos), "position_ids": pos}

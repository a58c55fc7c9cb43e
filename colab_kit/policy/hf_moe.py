"""Policies for Hugging Face ``transformers`` mixture-of-experts causal LMs: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE,
DeepSeek-V3, GPT-OSS.

They share Llama's frame (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``, a rotary
embedding every pipeline stage keeps); each MoE layer's ``mlp`` holds a router module (``gate``) and the
experts as fused 3D tensors (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), with a shared
expert beside them in DeepSeek-V3 (and Qwen2-MoE); GPT-OSS names its router ``router`` and lays its experts
out otherwise (``colab_kit.expert.hf.LAYOUTS``). The policy names the MoE layers in ``experts`` (DeepSeek-V3's
first ``first_k_dense_replace`` layers and Qwen3-MoE's ``mlp_only_layers`` are dense and left out); the expert
step of ``ck.parallelize`` cuts each one's fused tensors over ep (``colab_kit.expert.hf``), and ``boost``'s
policy check makes the routers count HF's load-balancing loss over the whole batch (``colab_kit.models.hf_moe``,
``engine.checks.count_router_loss``: the policy layer sits below the models and imports none).

Worked example, ``MixtralForCausalLM`` with 4 layers of 4 experts under ``ParallelConfig(dp=4, ep=2)``: rank 1
(ep 1) holds experts 2-3 of every layer (``gate_up_proj [2, 2I, H]``); its tokens routed to experts 0-1 go to
ep rank 0 by all-to-all and come back; attention, norms, routers and embeddings are whole on every rank,
averaged over dp; the experts' gradients over the ranks holding the same experts (edp ``[1, 3]``).

What runs (``tests/ranks/test_hf_moe.py``): dp, ep, ZeRO 1-3 (ep with 1-2), recomputation, 1D tp (every tp
rank routes the same tokens: the MoE layers run whole on each, the dense layers' MLPs split as Llama's),
sp ring and Ulysses, and pp (1f1b, zb-h1, zb-v;
with the load-balancing loss on, each microbatch's router counts ride the pipeline's messages:
``models.hf_moe.CountsRelay``). Refused under tp with the
rule (``tensor.part``, from ``attention_limits``): DeepSeek-V3's multi-head latent attention (no tensor plan) and
OLMoE (q/k norms over all heads); tp, sp and pp with GPT-OSS (attention sinks, sliding windows: dp, ep and ZeRO
run it); 2D/2.5D/3D tp and split_gather for every MoE model.
"""
from __future__ import annotations

import torch.nn as nn

from . import Attention, Policy
from .hf import _llama_context

__all__ = ["hf_moe_policy", "moe_layer_paths", "dense_mlp_layers", "attention_limits", "MOE_CLASSES"]

MOE_CLASSES = {  # transformers' module:class -> the policy's name
    "transformers.models.mixtral.modeling_mixtral:MixtralForCausalLM": "hf-mixtral",
    "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeForCausalLM": "hf-qwen3-moe",
    "transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeForCausalLM": "hf-qwen2-moe",
    "transformers.models.olmoe.modeling_olmoe:OlmoeForCausalLM": "hf-olmoe",
    "transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3ForCausalLM": "hf-deepseek-v3",
    "transformers.models.gpt_oss.modeling_gpt_oss:GptOssForCausalLM": "hf-gpt-oss",
}


def moe_layer_paths(model: nn.Module, blocks: str = "model.layers") -> list[str]:
    """Paths of the ``mlp`` of every decoder layer whose MLP is a mixture of experts: a router (``gate``, GPT-OSS's
    ``router``) and fused experts (``experts``) inside."""
    out = []
    layers: nn.Module = model.get_submodule(blocks)
    for i, layer in enumerate(layers.children()):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and (hasattr(mlp, "gate") or hasattr(mlp, "router")) and hasattr(mlp, "experts"):
            out.append(f"{blocks}.{i}.mlp")
    return out


def dense_mlp_layers(model: nn.Module, blocks: str = "model.layers") -> dict[str, str]:
    """The tensor roles of the dense MLPs among the MoE layers (Qwen3-MoE's ``mlp_only_layers``): gate and up split
    by columns, down by rows, as a Llama MLP; an MoE layer's router, experts and shared experts run whole on every
    tp rank. Named where the attention has a tensor plan (DeepSeek-V3's and GPT-OSS's have none: no tp at all).

        >>> import torch, transformers as tf
        >>> with torch.device("meta"):
        ...     m = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...         num_attention_heads=4, num_key_value_heads=2, num_experts=4, moe_intermediate_size=32,
        ...         vocab_size=64, mlp_only_layers=[0]))
        >>> sorted(dense_mlp_layers(m).items())  # doctest: +NORMALIZE_WHITESPACE
        [('model.layers.0.mlp.down_proj', 'row'), ('model.layers.0.mlp.gate_proj', 'column'),
         ('model.layers.0.mlp.up_proj', 'column')]
    """
    moe = set(moe_layer_paths(model, blocks))
    out = {}
    for i, layer in enumerate(model.get_submodule(blocks).children()):
        mlp, path = getattr(layer, "mlp", None), f"{blocks}.{i}.mlp"
        if path not in moe and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj",
                                                                                          "down_proj")):
            out.update({f"{path}.gate_proj": "column", f"{path}.up_proj": "column", f"{path}.down_proj": "row"})
    return out


def hf_moe_sizes(model) -> tuple[int, int]:
    """``(experts per layer, top_k)`` as the causal LM's load-balancing loss reads them."""
    cfg = model.config
    n = getattr(model, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.num_experts
    return int(n), int(getattr(model, "num_experts_per_tok", None) or cfg.num_experts_per_tok)


def hf_moe_policy(model) -> Policy:
    """The policy of a ``transformers`` MoE causal LM of ``MOE_CLASSES`` (see the module docstring)."""
    cfg, L = model.config, "model.layers"
    key = f"{type(model).__module__}:{type(model).__qualname__}"
    name = next((v for k, v in MOE_CLASSES.items() if k == key), "hf-moe")
    layers = {"model.embed_tokens": "vocab", "model.rotary_emb": "rotary", f"{L}.*.input_layernorm": "rmsnorm",
              f"{L}.*.post_attention_layernorm": "rmsnorm", "model.norm": "rmsnorm", "lm_head": "head"}
    attention = {f"{L}.*.self_attn": Attention(n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_attention_heads,
                                               hf=True)}
    if _sinks(model):  # attention sinks, sliding windows: dp and ep only (``attention_limits``)
        attention = {}
    elif not _latent(model):  # multi-head latent attention: no tensor plan (``attention_limits``)
        layers.update({f"{L}.*.self_attn.{p}_proj": r for p, r in
                       (("q", "column"), ("k", "column"), ("v", "column"), ("o", "row"))})
        attention = {f"{L}.*.self_attn": Attention(n_heads=cfg.num_attention_heads,
                                                   n_kv_heads=cfg.num_key_value_heads, hf=True)}
        layers.update(dense_mlp_layers(model, L))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return Policy(
        name=name, blocks=L, layers=layers, attention=attention,
        tied=(("model.embed_tokens", "lm_head"),) if tied else (),
        output=lambda out: out.logits, embed=lambda m, ids: m.model.embed_tokens(ids),
        finish=lambda m, x: m.lm_head(m.model.norm(x)), context=_llama_context,
        tail=("model.norm", "lm_head"), everywhere=("model.rotary_emb",), loss="tokens",
        experts=tuple(moe_layer_paths(model)))


def _latent(model) -> bool:
    """Whether the attention is DeepSeek's multi-head latent attention (a low-rank latent of keys and values)."""
    return getattr(model.config, "kv_lora_rank", None) is not None


def _whole_qk_norm(model) -> bool:
    """Whether the attention normalises q (and k) over all heads' features at once (OLMoE's ``q_norm``), rather
    than head by head (Qwen3's): a split of the heads cannot compute those statistics locally."""
    attn = model.get_submodule("model.layers.0.self_attn")
    norm = getattr(attn, "q_norm", None)
    head_dim = getattr(attn, "head_dim", None)
    return norm is not None and head_dim is not None and norm.weight.numel() != head_dim


def _sinks(model) -> bool:
    """Whether the attention has learned sinks per head (GPT-OSS), with sliding-window layers among full ones."""
    return hasattr(model.get_submodule("model.layers.0.self_attn"), "sinks")


def attention_limits(model: nn.Module) -> dict[str, bool]:
    """What a ``MOE_CLASSES`` model's attention keeps from the engine's plans, for the parts' rules: ``sinks``
    (GPT-OSS: a learned sink per head, sliding windows; no tensor, sequence or pipeline plan), ``latent``
    (DeepSeek-V3's multi-head latent attention: no tensor plan), ``qk_norm`` (OLMoE: q and k normalised over
    all heads at once, which a split of the heads cannot compute locally); {} for any other model."""
    key = f"{type(model).__module__}:{type(model).__qualname__}"
    if key not in MOE_CLASSES:
        return {}
    return {"sinks": _sinks(model), "latent": _latent(model), "qk_norm": _whole_qk_norm(model)}

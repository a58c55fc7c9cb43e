"""A decoder transformer in the at-scale cost model's terms: widths, counts and FLOPs, no tensors.

``ModelShape`` is what ``ck.estimate`` and the at-scale ``ck.plan`` price. It is built from a ``GPTConfig``,
a built-in model, or any model with a policy (a Hugging Face ``LlamaForCausalLM`` on the meta device: no
weights allocated) by ``ModelShape.of(model)``, or written out by hand for a published run.

Worked example, the GPT-3 175B of Megatron-LM's Table 1 (96 layers, hidden 12,288, 96 heads, vocab 51,200,
sequence 2,048)::

    >>> s = ModelShape(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048)
    >>> round(s.params / 1e9, 1)                  # 12 l h^2 (1 + 13 / 12h) + (2V + s + 2) h, untied head
    175.2
    >>> round(s.flops_per_token() / 1e12, 4)      # 72 l h^2 (1 + s/6h + V/12lh): forward 1x, backward 2x
    1.0764
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..config import ConfigError
from ..models import GPT, GPTConfig
from ..models.moe import has_experts
from ..policy import missing_policy_message, policy_for
from ..sharded_init import meta_twin
from ..tensor import model_sizes
from .moe_shape import gpt_moe_shape, hf_experts, hf_moe_shape
from .saves import BlockSaves, mlp_columns, read_block

__all__ = ["ModelShape", "is_moe", "model_from_hf_config"]


def is_moe(model) -> bool:
    """Whether ``model`` (a ``GPTConfig``, a model, or a Hugging Face config) is a mixture of experts: ``n_experts``,
    MoE layers inside, a policy naming some (``Policy.experts``: Mixtral, DeepSeek-V3, ...), or a Hugging Face
    config with routed experts (``num_local_experts``, ``num_experts``, ``n_routed_experts``)."""
    if isinstance(model, GPT):
        model = model.cfg
    if isinstance(model, GPTConfig):
        return bool(model.n_experts)
    if isinstance(model, nn.Module):
        policy = policy_for(model)
        return has_experts(model) or bool(policy is not None and policy.experts)
    return any(getattr(model, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts"))


@dataclass(frozen=True)
class ModelShape:
    """Widths and counts of a decoder-only transformer (pre-norm blocks of attention and an MLP).

    ``ffn`` is the MLP's inner width (``4 * hidden`` when 0); ``gated``: a SwiGLU MLP of three matrices
    (gate, up, down) instead of two; ``kv_heads``: grouped-query attention's key/value heads (``heads`` when
    0); ``tied``: the output head shares the token table; ``positions``: a learned position table of
    ``seq`` rows (GPT) rather than rotary (Llama). A block's small vectors are a GPT's LayerNorms and
    biases, or a gated (Llama) block's two RMSNorm weights (``block_params``). ``params_exact``: the true count
    where the model was read (0: the formula)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    kv_heads: int = 0
    gated: bool = False
    tied: bool = False
    positions: bool = True
    name: str = "GPT"
    params_exact: int = 0
    experts: int = 0
    """Routed experts of each MoE layer (0: a dense model); ``memory.moe_shape`` reads them from a model."""
    top_k: int = 0
    d_expert: int = 0
    """One routed expert's inner width (its MLP is gated like the dense one's, ``gated``)."""
    shared_ffn: int = 0
    """The shared experts' inner width, all of them together (an MLP every token passes)."""
    moe_blocks: tuple = ()
    """Indices of the blocks whose MLP is an MoE layer (the others have the dense MLP of width ``ffn``)."""
    attn_params: int = 0
    """Weights of one block's attention matrices where read from a model (multi-head latent attention,
    a q width other than ``hidden``); 0: the formula ``h * qkv_out + h * h``."""
    core_width: int = 0
    """Width of attention's core per token, the mean of the q.k and the v widths over the heads (DeepSeek-V3's
    MLA: (128 x 192 + 128 x 128) / 2); 0: ``hidden``."""
    drops: bool = False
    """Whether the MoE layers have a capacity (they drop assignments; the engine refuses them under sp)."""
    causal: bool = True
    """Whether attention masks future tokens (decoder LMs; BERT and ViT do not): a FlashAttention-priced core
    computes half of the square (``planner.cluster.compute``); the policy's ``Attention.causal`` where read."""
    norm: str = ""
    """The blocks' norm as the engine runs it: "layer" (LayerNorm) or "rms" (Hugging Face's RMSNorm, computed in
    fp32); "": "rms" when ``gated`` (a Llama, which the engine runs as Hugging Face's), "layer" otherwise."""
    qk_norm: str = ""
    """RMSNorms on q and k: "head" (Qwen3, Qwen3-MoE), "full" (OLMoE: over the whole width), "": none."""
    linears: tuple = ()
    """(output width, split over tp) of one block's matmuls in forward order, where read from a model; ():
    a GPT's fused qkv, proj, fc1, fc2, or a gated block's q, k, v, o, gate, up, down."""
    rotary: bool | None = None
    """Rotary positions kept as tables a forward (``BlockSaves.rotary``); None: as ``gated`` without ``positions``."""
    latent: tuple = ()
    """Multi-head latent attention's ``(q rank, kv rank, rope dim, nope dim, v dim)`` (``BlockSaves.latent``)."""
    act_saves: int = 0
    """MLP-wide tensors the MLP's activation keeps beside its input (``BlockSaves.act_saves``: GPT-2's tanh GELU 3)."""
    sinks: bool = False
    """Eager attention with a sink a head (GPT-OSS: its probabilities over the sequence and the sink kept)."""
    block_counts: tuple = ()
    """Each block's parameters ``(whole, split over 1D tp, routed experts)`` read off a Hugging Face mixture of
    experts (``memory.moe_shape``: q/k norms, attention and expert biases, sinks, a shared expert's gate counted as
    they are); (): ``layer_params``' formula. Kept by ``dataclasses.replace``, as ``moe_saves``; one per block."""
    moe_saves: Any = None
    """What one MoE layer saves, traced off a Hugging Face model's layer (``memory.moe_saves.MoELayerSaves``) when
    the shape is read; None: the MoE GPT's table (``memory.experts``). A shape made from another by
    ``dataclasses.replace`` keeps what was read at the old widths: pass ``moe_saves=None, block_counts=(),
    linears=()`` with new ones."""

    def __post_init__(self):
        for key in ("layers", "hidden", "heads", "vocab", "seq"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"ModelShape.{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape: heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.block_counts and len(self.block_counts) != self.layers:
            raise ValueError(f"ModelShape: block_counts has {len(self.block_counts)} blocks for layers={self.layers} "
                             f"(read at other widths: pass block_counts=() with new ones)")
        if self.experts and not (1 <= self.top_k <= self.experts and self.d_expert > 0 and self.moe_blocks):
            raise ValueError(f"ModelShape: experts={self.experts} needs 1 <= top_k <= experts, d_expert > 0 and the "
                             f"MoE blocks, got top_k={self.top_k}, d_expert={self.d_expert}, moe_blocks="
                             f"{self.moe_blocks!r}")

    # ------------------------------------------------------------------ from a model
    @classmethod
    def of(cls, model, policy=None, seq: int | None = None) -> ModelShape:
        """The shape of ``model``: a ``ModelShape`` (as it is), a ``GPTConfig`` or ``GPT``, a Hugging Face
        config (``LlamaConfig(...)``: the model is built from it on the meta device, no weights allocated), or
        any ``nn.Module`` with a policy (read on a meta copy; a model already on the meta device costs nothing).
        ``seq``: the training sequence length (default: the model's own).

            >>> ModelShape.of(GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)).params
            110336
        """
        if isinstance(model, ModelShape):
            return model if seq is None else dataclasses.replace(model, seq=seq)
        if isinstance(model, GPT):
            model = model.cfg
        if isinstance(model, GPTConfig) and model.n_experts:
            return gpt_moe_shape(cls, model, seq)
        if isinstance(model, nn.Module) and has_experts(model) and isinstance(getattr(model, "cfg", None), GPTConfig):
            return gpt_moe_shape(cls, model.cfg, seq)
        if isinstance(model, GPTConfig):
            return cls(layers=model.n_layers, hidden=model.d_model, heads=model.n_heads, vocab=model.vocab_size,
                       seq=seq or model.seq_len, ffn=model.d_ff or 4 * model.d_model, name="GPT")
        if not isinstance(model, nn.Module) and hasattr(model, "model_type") and hasattr(model, "to_dict"):
            model = model_from_hf_config(model)
        if isinstance(model, nn.Module) and hf_experts(model):
            return hf_moe_shape(cls, model, seq)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"ModelShape.of takes a GPTConfig, a model (an nn.Module with a policy) or a Hugging "
                              f"Face config, got {type(model).__name__}: e.g. LlamaConfig(...) or GPTConfig(...)")
        return _of_module(cls, model, policy, seq)

    # ------------------------------------------------------------------ widths
    @property
    def d_ff(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_out(self) -> int:
        """Output width of the fused q, k, v projection: ``h + 2 * kv_heads * head_dim``."""
        return self.hidden + 2 * self.n_kv * self.head_dim

    def attention_params(self) -> int:
        """Weights of one block's attention matrices (q, k, v and the output): read, or the formula."""
        return self.attn_params or self.hidden * self.qkv_out + self.hidden * self.hidden

    def mlp_params(self, width: int) -> int:
        """One MLP of inner ``width``: two or three (gated) matrices, and a GPT's two biases."""
        h = self.hidden
        return (3 * h * width) if self.gated else (2 * h * width + width + h)

    def block_matmul_params(self) -> int:
        """Weights of one dense block's matrices (q, k, v, the attention's output, the MLP's two or three)."""
        return self.attention_params() + (3 if self.gated else 2) * self.hidden * self.d_ff

    def block_params(self) -> int:
        """One dense block's parameters: its matrices and (formula) ``13 h`` of norms and biases for a GPT,
        ``2 h`` of RMSNorm weights for a gated (Llama) block."""
        if self.gated:
            return self.block_matmul_params() + 2 * self.hidden
        return self.block_matmul_params() + self.qkv_out + self.d_ff + 6 * self.hidden  # biases, 2 LayerNorms

    def block_saves(self) -> BlockSaves:
        """What one dense block saves for backward as the engine runs it (``memory.saves``): the norm, the
        attention's q and key/value widths, q/k norms, the gated MLP, rotary tables and the matmuls' order.

            >>> s = ModelShape(32, 4096, 32, 128256, 8192, ffn=14336, kv_heads=8, gated=True, positions=False)
            >>> b = s.block_saves()
            >>> b.norm, b.q, b.kv, len(b.matmuls())
            ('rms', 4096, 1024, 7)
        """
        q = self.core_width or self.hidden
        return BlockSaves(hidden=self.hidden, heads=self.heads, ffn=self.d_ff, vocab=self.vocab, q_width=q,
                          kv_width=self.n_kv * (q // self.heads), kv_heads=self.n_kv,
                          norm=self.norm or ("rms" if self.gated else "layer"), gated=self.gated,
                          qk_norm=self.qk_norm, linears=tuple(self.linears),
                          rotary=(self.gated and not self.positions) if self.rotary is None else self.rotary,
                          latent=tuple(self.latent), sinks_keys=self.seq + 1 if self.sinks else 0,
                          act_saves=self.act_saves)

    # ------------------------------------------------------------------ mixtures of experts
    @property
    def expert_params(self) -> int:
        """One routed expert's parameters."""
        return self.mlp_params(self.d_expert) if self.experts else 0

    def moe_dense_params(self) -> int:
        """One MoE block without its routed experts: attention, norms, the router (``E x h``), shared experts."""
        shared = self.mlp_params(self.shared_ffn) if self.shared_ffn else 0
        return self.block_params() - self.mlp_params(self.d_ff) + self.experts * self.hidden + shared

    def layer_params(self, i: int) -> tuple[int, int]:
        """``(dense, routed experts)`` parameters of block ``i`` (read where ``block_counts`` has them)."""
        if self.block_counts:
            whole, split, routed = self.block_counts[i]
            return whole + split, routed
        if i in self.moe_blocks:
            return self.moe_dense_params(), self.experts * self.expert_params
        return self.block_params(), 0

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all of them less the routed experts it is not sent to."""
        return self.params - len(self.moe_blocks) * (self.experts - self.top_k) * self.expert_params

    @property
    def params(self) -> int:
        """All parameters: the true count where known, else the blocks, the token table (and position
        table), the final norm and an untied head."""
        return self.params_exact or _formula_params(self)

    # ------------------------------------------------------------------ FLOPs
    def forward_flops_per_token(self, seq: int | None = None) -> float:
        """Forward FLOPs of one token: ``2`` per weight of every matrix it passes (the blocks' and the
        head's), and attention's two products over the whole ``seq x seq`` square (``4 s h`` a layer;
        Megatron-LM's Eq. 3 counts the square, not the causal half)."""
        s = seq or self.seq
        moe = len(self.moe_blocks)
        mm = 3 if self.gated else 2  # matrices of an MLP
        per_token = self.hidden * (self.experts + mm * (self.shared_ffn + self.top_k * self.d_expert - self.d_ff))
        return 2 * (self.layers * self.block_matmul_params() + moe * per_token + self.vocab * self.hidden) \
            + 4 * self.layers * s * (self.core_width or self.hidden)

    def flops_per_token(self, seq: int | None = None) -> float:
        """Model FLOPs of one token trained: forward once, backward twice the forward; recomputation not
        counted (MFU's numerator, PaLM's convention). For a GPT (``ffn = 4h``, untied or tied head alike)
        this is Megatron-LM's Eq. 3 without its recomputed forward: ``72 l h^2 (1 + s/6h + V/12lh)``."""
        return 3 * self.forward_flops_per_token(seq)


@functools.lru_cache(maxsize=256)
def _formula_params(shape: ModelShape) -> int:
    """``ModelShape.params`` by the formula, once per shape: a sum over every block (a 128-layer shape: 128
    ``layer_params``), which the at-scale plan asked for twice per memory estimate (16,000 times for 175B).
    Keyed on the frozen shape (its every field), bounded: a notebook may price many models."""
    h = shape.hidden
    table = shape.vocab * h + (shape.seq * h if shape.positions else 0)
    norm = h if shape.gated else 2 * h  # the final RMSNorm (Llama) or LayerNorm
    blocks = sum(sum(shape.layer_params(i)) for i in range(shape.layers))
    return blocks + table + norm + (0 if shape.tied else shape.vocab * h)


def model_from_hf_config(config) -> nn.Module:
    """The causal LM of a Hugging Face config, built on the meta device (shapes only)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _of_module(cls, model: nn.Module, policy, seq: int | None) -> ModelShape:
    """A model with a policy, read on a meta copy: widths from ``tensor.model_sizes``, the MLP gated where a
    block has two column Linears outside attention (gate and up), the parameter count exact."""
    policy = policy_for(model, policy)
    if policy is None:
        raise ConfigError(missing_policy_message(model, "ck.estimate"))
    twin = model if all(p.is_meta for p in model.parameters()) else meta_twin(model)
    if policy.prepare is not None:
        if twin is model:  # prepare changes a model in place: never the user's own
            twin = meta_twin(model)
        policy.prepare(twin)
    sizes = model_sizes(twin, policy)
    blocks = policy.block_list(twin)
    cols = mlp_columns(twin, policy)
    vocab = sizes.outputs.get("vocab_size") or sizes.tables.get("vocab_size")
    hf = getattr(model, "config", None)
    max_seq = sizes.seq_len or int(getattr(hf, "max_position_embeddings", 0) or 0)
    if not vocab or not (seq or max_seq):
        raise ConfigError(f"ck.estimate prices decoder language models (a token table and a vocabulary head); "
                          f"{type(model).__name__} has {'no vocabulary' if not vocab else 'no sequence length'}: "
                          f"pass seq= or a causal LM")
    read = read_block(twin, policy)
    q = read["q_width"]
    attn = 0  # a q width other than hidden (Qwen3's head_dim): the attention's matrices read, as FLOPs count them
    if q != sizes.d_model and policy.attentions(twin):
        attn = sum(p.numel() for p in policy.attentions(twin)[0][1].parameters() if p.dim() >= 2)
    return cls(layers=len(blocks), hidden=sizes.d_model, heads=sizes.n_heads, vocab=vocab, seq=seq or max_seq,
               ffn=max(cols) if cols else sizes.d_ff, kv_heads=sizes.kv.get("n_kv_heads", 0), gated=len(cols) >= 2,
               tied=bool(sizes.tied), positions=bool(sizes.seq_len), name=type(model).__name__,
               params_exact=sum(p.numel() for p in twin.parameters()),
               causal=all(a.causal for _, _, a in policy.attentions(twin)), core_width=0 if q == sizes.d_model else q,
               norm=read["norm"], qk_norm=read["qk_norm"], linears=read["linears"], attn_params=attn,
               rotary=read["rotary"], act_saves=read["act_saves"])

"""``ModelFacts``: what the rules (each part's ``RULES``) need to know of a model, read once.

One description, built from whatever the caller holds, so that ``boost`` and ``ck.plan`` judge a config on
the same facts:

- an ``nn.Module``, through its policy (``ModelFacts.of(model, policy)``: what ``boost`` reads, after the
  policy's ``prepare``);
- a built-in ``GPTConfig`` (the facts of ``GPT(cfg)`` without building it: the local planner);
- a planner ``ModelShape`` (duck-typed: the engine does not import the planner), for a model written out by
  hand (a published run); what a shape cannot say (multi-head latent attention, an attention scale) is taken
  as the plain case.

Worked example: a Hugging Face Llama with 8 heads and 2 key/value heads, on the meta device::

    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    ...                                num_attention_heads=8, num_key_value_heads=2)
    >>> with torch.device("meta"):
    ...     llama = transformers.LlamaForCausalLM(cfg)
    >>> f = ModelFacts.of(llama)
    >>> f.policy, f.heads, f.kv_heads, f.layers, {"rmsnorm", "rotary"} <= set(f.sizes.roles)
    ('hf-llama', 8, 2, 4, True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch.nn as nn

from ..config import ConfigError
from ..expert.apply import expert_count, expert_modules
from ..models import GPTConfig
from ..models.experts import Experts
from ..models.hf_moe import aux_coef
from ..models.moe import has_experts, moe_blocks
from ..policy import policy_for
from ..policy.hf import sliding_window
from ..policy.hf_moe import attention_limits
from ..sequence.plan import scale_refusal
from ..tensor import model_sizes

__all__ = ["ModelFacts"]

_GPT_ROLES = {"vocab": "tok", "positions": "pos", "norm": "blocks.0.ln1", "column": "blocks.0.attn.qkv",
              "row": "blocks.0.attn.proj", "head": "head"}
"""The roles the built-in GPT's policy names (``policy.builtin.gpt_policy``), each with its first path."""


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """A model as the rules see it. ``sizes`` is what the tensor modes split (``tensor.model_sizes``: d_model,
    n_heads, kv, d_ff, seq_len, outputs, tables, inputs, roles, tied); None where the policy does not fit."""

    name: str
    """The model's class name (or the shape's name): what the messages call it."""
    policy: str | None
    """The policy's name; None: the model has no policy (dp and ZeRO only)."""
    policy_error: str | None = None
    """Why the policy does not fit the model (``Policy.check``), refused where a part needs the policy."""
    layers: int = 0
    """Blocks: where a pipeline cuts."""
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    seq: int | None = None
    """The training sequence where it is known (the planner's); None: the batch's, checked at the first step."""
    sizes: Any = None
    attends: bool = True
    """Every attention names its ``attend`` method or is transformers' (what sequence parallelism replaces)."""
    sequence: bool = True
    """The inputs have a token dimension (not ViT's images)."""
    bidirectional_hf: bool = False
    """A transformers attention that is not causal (the sequence plan runs those causally)."""
    scale: tuple[float, int] | None = None
    """``(scaling, head_dim)`` of a transformers attention scaled other than ``1 / sqrt(head_dim)``."""
    head_dims: tuple[int, int] = (0, 0)
    """q/k and v widths of one head (unequal: DeepSeek's multi-head latent attention); 0: unknown."""
    tied: tuple = ()
    """``(table, head)`` pairs that share a weight."""
    moe: bool = False
    """Mixture-of-experts layers: the policy names some, or the model holds the built-in ``MoE``."""
    experts: tuple[int, ...] = ()
    """The distinct numbers of routed experts of its MoE layers, () where none is found."""
    drops: bool = False
    """The MoE layers have a capacity (they drop assignments)."""
    policy_experts: bool = False
    """The policy names the MoE layers (where a Hugging Face load-balancing loss is counted)."""
    aux_coef: float = 0.0
    """The coefficient a Hugging Face MoE forward adds its load-balancing loss with (0: off)."""
    latent: bool = False
    """Multi-head latent attention (DeepSeek-V3): no tensor plan."""
    qk_norm: bool = False
    """q and k normalised over all heads at once (OLMoE): no tensor plan."""
    sinks: bool = False
    """Attention sinks and sliding windows (GPT-OSS): no tensor, sequence or pipeline plan."""
    window: int | None = None
    """A sliding window shorter than the model's positions (Mistral's; ``policy.hf.sliding_window``): no sequence
    or pipeline plan for sequences longer than it (refused where ``seq`` is known, else at the first batch)."""
    memo: dict = field(default_factory=dict, repr=False)
    """What a rule computed for a config's fields (a part's rule), kept with the facts it read."""

    @classmethod
    def of(cls, model, policy=None, *, seq: int | None = None) -> ModelFacts:
        """The facts of a module (through ``policy`` or its built-in one), a ``GPT``, a ``GPTConfig`` or a
        ``ModelShape``; ``seq``: the training sequence where known. A module is read as it is: a policy with a
        ``prepare`` (GPT-2's Conv1D) expects it done (``check_policy`` does it; the planner reads a prepared
        meta copy)."""
        if isinstance(model, ModelFacts):
            return model
        if isinstance(model, GPTConfig) or (not isinstance(model, nn.Module) and all(
                hasattr(model, k) for k in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff"))):
            return cls._of_gpt(model, seq)  # a GPTConfig, or a config of its fields the local planner reads
        if isinstance(model, nn.Module):
            return cls._of_module(model, policy, seq)
        if hasattr(model, "moe_blocks") and hasattr(model, "hidden"):
            return cls._of_shape(model, seq)
        raise ConfigError(f"ModelFacts.of takes a model (an nn.Module), a GPTConfig or a planner ModelShape, got "
                          f"{type(model).__name__}")

    @classmethod
    def _of_module(cls, model: nn.Module, policy, seq: int | None) -> ModelFacts:
        policy = policy_for(model, policy)
        counts = {m.n for m in model.modules() if isinstance(m, Experts)}
        base: dict = dict(name=type(model).__name__, seq=seq, aux_coef=aux_coef(model), **attention_limits(model),
                          window=sliding_window(model),
                          moe=bool(policy is not None and policy.experts) or has_experts(model),
                          policy_experts=bool(policy is not None and policy.experts),
                          drops=any(getattr(m, "capacity_factor", None) is not None for m in model.modules()
                                    if type(m).__name__ == "MoE"))
        if policy is None:
            return cls(policy=None, experts=tuple(sorted(counts)), **base)
        try:
            policy.check(model)
            counts |= {expert_count(e) for _, _, e in expert_modules(model, policy)}
            sizes = model_sizes(model, policy)
            atts = policy.attentions(model)
            layers = len(policy.block_list(model))
        except (ConfigError, AttributeError, TypeError, IndexError) as e:  # refused where a part needs the policy
            why = str(e) if isinstance(e, ConfigError) else f"policy {policy.name or '?'} does not fit " \
                                                              f"{type(model).__name__}: {e}"
            return cls(policy=policy.name, policy_error=why, experts=tuple(sorted(counts)), **base)
        scales = [(getattr(m, "scaling", None), getattr(m, "qk_head_dim", None) or getattr(m, "head_dim", None))
                  for _, m, a in atts if a.hf]
        odd = next(((s, d) for s, d in scales if isinstance(s, float) and d and scale_refusal(s, d)), None)
        first = atts[0][1] if atts else None
        qk = int(getattr(first, "qk_head_dim", None) or getattr(first, "head_dim", None) or 0)
        v = int(getattr(first, "v_head_dim", None) or qk)
        vocab = sizes.outputs.get("vocab_size") or sizes.tables.get("vocab_size") or 0
        hidden = sizes.d_model or int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)  # RMSNorms only
        return cls(policy=policy.name, layers=layers, hidden=hidden, heads=sizes.n_heads,
                   kv_heads=sizes.kv.get("n_kv_heads", sizes.n_heads), vocab=vocab, sizes=sizes,
                   attends=bool(atts) and all(a.attend is not None or a.hf for _, _, a in atts),
                   sequence=policy.sequence, bidirectional_hf=any(a.hf and not a.causal for _, _, a in atts),
                   scale=odd, head_dims=(qk, v), tied=tuple(policy.tied), experts=tuple(sorted(counts)), **base)

    @classmethod
    def _of_gpt(cls, cfg, seq: int | None) -> ModelFacts:
        """The built-in GPT's facts from its config, as ``_of_module`` reads them off ``GPT(cfg)``: the MLP's
        width is the dense blocks' (an MoE layer is not split by tp), d_model where every block is MoE."""
        moe = moe_blocks(cfg)
        d_ff = cfg.d_ff if len(moe) < cfg.n_layers else cfg.d_model
        v, d = cfg.vocab_size, cfg.d_model // cfg.n_heads
        sizes = SimpleNamespace(d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=d_ff, seq_len=cfg.seq_len,
                                outputs={"vocab_size": v}, tables={"vocab_size": v}, inputs={}, kv={},
                                dropout=getattr(cfg, "dropout", 0.0), roles=dict(_GPT_ROLES), tied=())
        return cls(name="GPT", policy="gpt", layers=cfg.n_layers, hidden=cfg.d_model, heads=cfg.n_heads,
                   kv_heads=cfg.n_heads, vocab=v, seq=seq, sizes=sizes, head_dims=(d, d), moe=bool(moe),
                   experts=(cfg.n_experts,) if moe else (), policy_experts=bool(moe),
                   drops=bool(moe) and getattr(cfg, "capacity_factor", None) is not None)

    @classmethod
    def _of_shape(cls, shape, seq: int | None) -> ModelFacts:
        """A planner ``ModelShape``: a GPT's roles, or (``gated``) a Llama's RMSNorms and rotary embedding; the
        MLP width a tensor mode splits is the dense blocks' (a Hugging Face MoE policy names no MLP: d_model)."""
        dense = len(shape.moe_blocks) < shape.layers
        d_ff = shape.d_ff if not shape.experts or (dense and not shape.gated) else shape.hidden
        roles = dict(_GPT_ROLES)
        if shape.gated:
            roles = {"vocab": "the token table", "rmsnorm": "the blocks' RMSNorms", "column": "q, k, v, gate, up",
                     "row": "o, down", "head": "the head"}
        if not shape.positions:
            roles.pop("positions", None)
            roles["rotary"] = "the rotary embedding"
        kv = shape.n_kv
        sizes = SimpleNamespace(d_model=shape.hidden, n_heads=shape.heads, d_ff=d_ff,
                                seq_len=shape.seq if shape.positions else 0, outputs={"vocab_size": shape.vocab},
                                tables={"vocab_size": shape.vocab}, inputs={},
                                kv={"n_kv_heads": kv} if kv != shape.heads else {}, dropout=0.0, roles=roles,
                                tied=(("the token table", "the head"),) if shape.tied else ())
        return cls(name=shape.name, policy="shape", layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                   kv_heads=kv, vocab=shape.vocab, seq=seq or shape.seq, sizes=sizes, tied=sizes.tied,
                   head_dims=(shape.head_dim, shape.head_dim), moe=bool(shape.experts),
                   experts=(shape.experts,) if shape.experts else (), drops=shape.drops,
                   policy_experts=bool(shape.experts))

"""``ModelShape`` (``colab_kit.memory.shape``: a decoder's widths, counts and FLOPs, read below the engine so that
``engine.memory_estimate()`` prices a mixture of experts by the same walk as ``ck.estimate``) and
``shape_and_facts``: a model's shape and the facts ``engine.rules`` judges a config by, read once."""
from __future__ import annotations

import torch.nn as nn

from ..engine.facts import ModelFacts
from ..memory.shape import ModelShape, is_moe, model_from_hf_config
from ..models import GPT, GPTConfig
from ..models.moe import has_experts
from ..policy import policy_for
from ..sharded_init import meta_twin

__all__ = ["ModelShape", "is_moe", "shape_and_facts"]


def shape_and_facts(model, policy=None, seq: int | None = None) -> tuple[ModelShape, ModelFacts]:
    """``model``'s ``ModelShape`` (what the cost models price) and its ``ModelFacts`` (what ``engine.rules`` judges
    a config by, as ``boost`` would), read once: a Hugging Face config is built on the meta device once for both;
    a module's facts are read off a meta copy its policy prepared (GPT-2's Conv1D -> nn.Linear: the caller's model
    is never changed); a GPTConfig's from its fields; a ``ModelShape``'s from its widths. The facts carry the
    training sequence (``shape.seq``).

        >>> s, f = shape_and_facts(GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2))
        >>> (s.heads, s.seq), (f.heads, f.seq, f.policy)
        ((4, 32), (4, 32, 'gpt'))
    """
    if isinstance(model, GPT):
        model = model.cfg
    if not isinstance(model, nn.Module) and hasattr(model, "model_type") and hasattr(model, "to_dict"):
        model = model_from_hf_config(model)
    if isinstance(model, nn.Module) and has_experts(model) and isinstance(getattr(model, "cfg", None), GPTConfig):
        model = model.cfg  # the built-in MoE GPT, as ModelShape.of reads it
    shape = ModelShape.of(model, policy, seq)
    if isinstance(model, GPTConfig):
        return shape, ModelFacts.of(model, seq=shape.seq)
    if not isinstance(model, nn.Module):
        return shape, ModelFacts.of(shape)
    found = policy_for(model, policy)
    if found is not None and found.prepare is not None:
        model = meta_twin(model)
        found.prepare(model)
    return shape, ModelFacts.of(model, found, seq=shape.seq)

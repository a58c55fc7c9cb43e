"""The policies of the models colab_kit ships: GPT, BERT and ViT (``colab_kit.models``).

They use the public ``Policy`` API exactly as a user's policy does. ``policy_for`` finds them by the
models' class paths (``policy._LAZY``) and imports this module on first use. The policies import no
model, not even for type hints (a policy sits below the models in the layers, ``docs/layout.md``): each
function takes the model as an ``nn.Module`` and reads it by the paths it names.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from . import Attention, Policy

__all__ = ["gpt_policy", "bert_policy", "vit_policy"]

_BLOCK = {"blocks.*.ln1": "norm", "blocks.*.ln2": "norm",
          "blocks.*.attn.qkv": "column", "blocks.*.attn.proj": "row",
          "blocks.*.mlp.fc1": "column", "blocks.*.mlp.fc2": "row"}
"""The pre-LN block every built-in model shares (``models.layers.Block``): fused q/k/v head by head."""


def _cfg(model: nn.Module) -> Any:
    """A built-in model's config (``GPTConfig``, ``BERTConfig``, ``ViTConfig``): its ``cfg`` field."""
    return model.cfg


def _attention(causal: bool) -> dict[str, Attention]:
    return {"blocks.*.attn": Attention(heads=("n_heads",), attend="attend", causal=causal)}


def gpt_policy(model: nn.Module) -> Policy:
    """GPT: token and position tables, the blocks, ``ln_f`` and an untied LM head. With MoE blocks
    (``GPTConfig(n_experts=...)``): the dense MLPs named block by block, the MoE layers in ``experts``."""
    cfg = _cfg(model)
    moe = [i for i in range(cfg.n_layers) if getattr(cfg, "n_experts", 0) and (i + 1) % cfg.moe_every == 0]
    block = _BLOCK
    if moe:
        block = {p: r for p, r in _BLOCK.items() if ".mlp." not in p}
        block.update({f"blocks.{i}.mlp.{fc}": r for i in range(cfg.n_layers) if i not in moe
                      for fc, r in (("fc1", "column"), ("fc2", "row"))})
    return Policy(name="gpt", blocks="blocks",
                  layers={"tok": "vocab", "pos": "positions", **block, "ln_f": "norm", "head": "head"},
                  attention=_attention(causal=True),
                  embed=lambda m, tokens: m.embed(tokens), finish=lambda m, x: m.head(m.ln_f(x)),
                  tail=("ln_f", "head"), loss="tokens", experts=tuple(f"blocks.{i}.mlp" for i in moe))


def bert_policy(model: nn.Module) -> Policy:
    """BERT: token, position and token-type tables and their LayerNorm, bidirectional blocks, the masked-LM
    head (a width-keeping transform, its LayerNorm, and the decoder tied to the token table)."""
    return Policy(name="bert", blocks="blocks",
                  layers={"tok": "vocab", "pos": "positions", "typ": "table", "ln_e": "norm", **_BLOCK,
                          "mlm.dense": "dense", "mlm.ln": "norm", "mlm.decoder": "head"},
                  attention=_attention(causal=False),
                  embed=lambda m, ids: m.embed(ids), finish=lambda m, x: m.mlm(x),
                  tail=("mlm",), loss="tokens", context=lambda m, ids: {"mask": m.padding_mask(ids)},
                  tied=(("tok", "mlm.decoder"),) if _cfg(model).tie_embeddings else ())


def vit_policy(model: nn.Module) -> Policy:
    """ViT: the patch embedding (a Linear on flattened patches), class token and position tables,
    bidirectional blocks, the final LayerNorm and the classification head on the class token."""
    return Policy(name="vit", blocks="blocks",
                  layers={"patch": "input", "cls": "table", "pos": "positions", **_BLOCK, "ln_f": "norm",
                          "head": "head"},
                  attention=_attention(causal=False),
                  embed=lambda m, images: m.embed(images), finish=lambda m, x: m.classify(x),
                  tail=("ln_f", "head"), loss="classes", sequence=False)

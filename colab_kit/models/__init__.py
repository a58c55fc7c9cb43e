"""Models built so that the engine can shard them; no parallel code lives here (their policies:
``colab_kit.policy.builtin``)."""
from .bert import BERT, BERTConfig
from .dropout import Dropout, layout_invariant
from .gpt import GPT, Attention, Block, GPTConfig, MLP
from .moe import MoE, moe_loss, update_router_bias
from .vit import ViT, ViTConfig

__all__ = ["GPT", "GPTConfig", "BERT", "BERTConfig", "ViT", "ViTConfig", "Block", "Attention", "MLP", "Dropout",
           "layout_invariant", "MoE", "moe_loss", "update_router_bias"]

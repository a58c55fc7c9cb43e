"""Models built so that the engine can shard them; no parallel code lives here."""
from .gpt import GPT, Attention, Block, GPTConfig, MLP

__all__ = ["GPT", "GPTConfig", "Block", "Attention", "MLP"]

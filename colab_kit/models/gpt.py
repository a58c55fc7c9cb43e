"""A small decoder-only transformer (GPT) that the engine can shard and stage.

Token and position embeddings, ``n_layers`` pre-LayerNorm blocks (causal
self-attention, then a GELU MLP) kept in ``model.blocks`` so that a pipeline can
cut between them, a final LayerNorm and an untied LM head. Q, K and V come from one
fused projection ``attn.qkv`` whose output features are laid out head by head
(Megatron's order: ``[h0 q | h0 k | h0 v | h1 q | ...]``, ``head_dim`` each), so any
contiguous split of its output features is a set of whole heads with their q, k and v,
and a tensor-parallel plan communicates the attention's input once, not three times.
The model knows nothing about parallelism.

Parameters come from the config's seed alone (the global RNG is left as it
was), so every rank that builds ``GPT(cfg)`` holds identical weights. Each
parameter draws from its own generator, seeded with ``(cfg.seed, its name)``
(``GPT.init_parameter``), so any one of them can be rebuilt alone, in any order:
``GPT(cfg, device="meta")`` holds shapes only, and ``ck.boost`` builds from it just
this rank's shards, equal to the dense model's (``colab_kit.init``)::

    >>> cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)
    >>> a, b = GPT(cfg), GPT(cfg)
    >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    True
    >>> GPT(cfg)(torch.zeros(8, 32, dtype=torch.long)).shape
    torch.Size([8, 32, 64])
    >>> meta = GPT(cfg, device="meta")
    >>> w = torch.empty(meta.head.weight.shape)
    >>> torch.equal(meta.init_parameter("head.weight", w), a.head.weight)
    True
"""
from __future__ import annotations

import hashlib
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "Block", "Attention", "MLP"]


@dataclass
class GPTConfig:
    vocab_size: int = 64
    """Number of token ids."""
    seq_len: int = 32
    """Longest sequence (size of the position table)."""
    d_model: int = 64
    """Hidden size."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_layers: int = 2
    """Transformer blocks."""
    d_ff: int | None = None
    """MLP inner size; 4 * d_model when None."""
    dropout: float = 0.0
    """Dropout on attention output and MLP output; 0.0 keeps training deterministic."""
    seed: int = 0
    """Seed of the parameter initialisation."""

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}: "
                             f"try d_model={self.n_heads * max(1, round(self.d_model / self.n_heads))}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Attention(nn.Module):
    """Causal multi-head self-attention: one fused q, k, v projection, softmax(qk^T/sqrt(d)) v, out projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # head by head: [q k v] of h0, then h1, ...
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # heads = out_features / (3 head_dim), so a layer holding a slice of heads works unchanged
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim).transpose(1, 2)  # [b, heads, t, 3, head_dim]
        q, k, v = qkv.unbind(3)
        y = self.attend(q, k, v)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v over ``[b, heads, t, head_dim]`` (a parallel plan may
        replace it on an instance, e.g. sequence parallelism's ring attention)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(tokens [b, t]) -> logits [b, t, vocab]``.

    ``device="meta"`` builds the modules with shapes and no storage (the same as
    ``with torch.device("meta"): GPT(cfg)``); ``ck.boost`` then builds each rank's shards.
    """

    def __init__(self, cfg: GPTConfig, device: str | torch.device | None = None):
        super().__init__()
        self.cfg = cfg
        # nn's default init draws from the global RNG (init_parameter then overwrites it all): leave it as it was
        with torch.random.fork_rng(devices=[]), (torch.device(device) if device is not None else nullcontext()):
            # tables made empty (init_parameter fills them): nn.Embedding's own normal_ on the meta
            # device would import torch._dynamo, seconds in every rank
            self.tok = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.d_model), freeze=False)
            self.pos = nn.Embedding.from_pretrained(torch.empty(cfg.seq_len, cfg.d_model), freeze=False)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if not p.is_meta:  # a meta parameter is built later, from its name (colab_kit.init)
                self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Fill ``tensor`` (shaped like the parameter called ``name``) with its initial values; return it.

        GPT-2's recipe: LayerNorm weights 1, biases 0, matrices N(0, 0.02), the residual
        projections (``proj``, ``fc2``) scaled by 1/sqrt(2 n_layers). The draws come from a
        generator seeded with ``(cfg.seed, name)`` alone: the values do not depend on which
        other parameters were made before, so ``init_parameter("blocks.1.mlp.fc1.weight", t)``
        gives the dense model's ``blocks[1].mlp.fc1.weight`` on its own.
        """
        if tensor.dim() == 1:
            return tensor.zero_() if name.endswith("bias") else tensor.fill_(1.0)
        std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
        digest = hashlib.blake2b(f"{self.cfg.seed}/{name}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        if tensor.device.type == "cpu":
            return tensor.normal_(0.0, std, generator=gen)
        # the generator is a CPU one: draw there, so that every device gets the same values
        return tensor.copy_(torch.empty(tensor.shape, dtype=tensor.dtype).normal_(0.0, std, generator=gen))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than GPTConfig.seq_len={self.cfg.seq_len}")
        return self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

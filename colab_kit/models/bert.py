"""BERT (Devlin et al. 2018, arXiv 1810.04805) in miniature: a bidirectional encoder with a masked-LM head.

Token, position and token-type tables summed and normalised, ``n_layers`` post-LN blocks
(bidirectional attention with a key-padding mask, then a GELU MLP; ``models.layers``), and the
masked-LM head: a width-keeping ``dense`` Linear, GELU, LayerNorm and a ``decoder`` to the
vocabulary whose weight is the token table's (``tie_embeddings``). Tokens equal to ``pad_id`` are
padding: no query attends to them. No parallel code lives here (its policy:
``colab_kit.policy.builtin.bert_policy``).

The batch is ``(ids [b, t], targets [b, t])`` with ``targets = -100`` where a token is not
predicted; the loss is the mean cross-entropy over the predicted tokens of the whole batch
(``F.cross_entropy``'s ``ignore_index``)::

    >>> cfg = BERTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    >>> model = BERT(cfg)
    >>> model(torch.ones(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 64])
    >>> model.mlm.decoder.weight is model.tok.weight
    True
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dropout import layout_invariant
from .layers import Block, check_config, init_by_name

__all__ = ["BERTConfig", "BERT", "MaskedLMHead"]


@dataclass
class BERTConfig:
    vocab_size: int = 64
    """Number of token ids (``pad_id`` among them)."""
    seq_len: int = 32
    """Longest sequence (size of the position table)."""
    d_model: int = 64
    """Hidden size."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_layers: int = 2
    """Encoder blocks."""
    d_ff: int | None = None
    """MLP inner size; 4 * d_model when None."""
    dropout: float = 0.0
    """Dropout on attention output and MLP output."""
    type_vocab_size: int = 2
    """Token types (segments); the batch carries none, so every token is type 0."""
    pad_id: int = 0
    """The padding token: keys equal to it are masked out of attention."""
    tie_embeddings: bool = True
    """The MLM decoder's weight is the token table (BERT's choice)."""
    eps: float = 1e-12
    """LayerNorm epsilon (BERT's)."""
    seed: int = 0
    """Seed of the parameter initialisation."""

    def __post_init__(self):
        check_config(self, ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"))
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id={self.pad_id} must be a token id below vocab_size={self.vocab_size}")


class MaskedLMHead(nn.Module):
    """``decoder(ln(gelu(dense(x))))``: logits over the vocabulary at every position."""

    def __init__(self, cfg: BERTConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x))))


class BERT(nn.Module):
    """``forward(ids [b, t]) -> logits [b, t, vocab]``; ``device="meta"`` builds shapes only."""

    def __init__(self, cfg: BERTConfig, device: str | torch.device | None = None):
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]), (torch.device(device) if device is not None else nullcontext()):
            def table(n):
                return nn.Embedding.from_pretrained(torch.empty(n, cfg.d_model), freeze=False)

            self.tok, self.pos, self.typ = table(cfg.vocab_size), table(cfg.seq_len), table(cfg.type_vocab_size)
            self.ln_e = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
            self.blocks = nn.ModuleList(Block(cfg, causal=False, pre_norm=False, eps=cfg.eps)
                                        for _ in range(cfg.n_layers))
            self.mlm = MaskedLMHead(cfg)
        if cfg.tie_embeddings:
            self.mlm.decoder.weight = self.tok.weight
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p)
        layout_invariant(self, seed=cfg.seed)  # each dropout numbered: masks that do not depend on the split

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """BERT's recipe (N(0, 0.02) matrices, LayerNorm 1 and 0, zero biases), each tensor drawn from
        ``(cfg.seed, name)`` alone, so a meta model's shards can be made one by one
        (``colab_kit.sharded_init``)."""
        return init_by_name(name, tensor, self.cfg.seed, 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers))

    def padding_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """True where a token is real (not ``pad_id``): the keys attention may look at."""
        return ids != self.cfg.pad_id

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than BERTConfig.seq_len={self.cfg.seq_len}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device)) + self.typ(torch.zeros_like(ids))
        return self.ln_e(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = self.padding_mask(ids)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.mlm(x)

"""The transformer pieces the built-in models share: attention, MLP, block, seeded initialisation.

No parallel code lives here. Q, K and V come from one fused projection ``attn.qkv`` whose output
features are laid out head by head (Megatron's order: ``[h0 q | h0 k | h0 v | h1 q | ...]``,
``head_dim`` each), so any contiguous split of its output features is a set of whole heads with
their q, k and v, and a tensor-parallel plan communicates the attention's input once, not three
times. The head count the forward uses is ``n_heads``, which a plan that splits heads divides
(the policy names it: ``colab_kit.policy.Attention(heads=("n_heads",))``).

``Block(cfg, causal=True, pre_norm=True)`` is GPT's (``x + attn(ln1(x))``); BERT's is post-LN
(``ln1(x + attn(x))``) and bidirectional; ViT's is pre-LN and bidirectional. A key-padding mask
``[b, t]`` (True where a token is real) may be passed to a block: ``block(x, mask=mask)``.
Dropout is ``colab_kit.models.dropout.Dropout``: its masks do not depend on how a tensor is split, so a
model with dropout trains under every config to the losses of one process.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dropout import Dropout

__all__ = ["Attention", "MLP", "Block", "seeded_normal_", "init_by_name", "check_config"]


class Attention(nn.Module):
    """Multi-head self-attention: one fused q, k, v projection, softmax(qk^T/sqrt(d)) v, out projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.n_heads, self.head_dim, self.causal = n_heads, d_model // n_heads, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)  # head by head: [q k v] of h0, then h1, ...
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_heads, 3, self.head_dim).transpose(1, 2)  # [b, heads, t, 3, d]
        q, k, v = qkv.unbind(3)
        y = self.attend(q, k, v) if mask is None else self.attend(q, k, v, mask)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v over ``[b, heads, t, head_dim]``, causal or not, keys masked where
        ``mask [b, t]`` is False (sequence parallelism replaces it on the instance: ring or all-to-all)."""
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        allowed = mask[:, None, None, :]
        if self.causal:
            t = q.shape[-2]
            allowed = allowed & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Transformer block: pre-LN ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, or post-LN
    ``ln1(x + attn(x))``, ``ln2(x + mlp(x))`` (BERT's)."""

    def __init__(self, cfg, causal: bool = True, pre_norm: bool = True, eps: float = 1e-5):
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.dropout, causal)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.ln1(x), mask)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x, mask))
        return self.ln2(x + self.mlp(x))


@torch.no_grad()
def seeded_normal_(tensor: torch.Tensor, seed: int, name: str, std: float) -> torch.Tensor:
    """Fill ``tensor`` with N(0, std) drawn from a generator seeded with ``(seed, name)`` alone, on the
    CPU, so every device and every order of construction gets the same values."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    if tensor.device.type == "cpu":
        return tensor.normal_(0.0, std, generator=gen)
    return tensor.copy_(torch.empty(tensor.shape, dtype=tensor.dtype).normal_(0.0, std, generator=gen))


@torch.no_grad()
def init_by_name(name: str, tensor: torch.Tensor, seed: int, std: float, residual_std: float) -> torch.Tensor:
    """GPT-2's recipe by parameter name: 1-d tensors are LayerNorm weights (1) or biases (0); matrices
    N(0, std), the residual projections (``proj``, ``fc2``) N(0, residual_std)."""
    if tensor.dim() == 1:
        return tensor.zero_() if name.endswith("bias") else tensor.fill_(1.0)
    return seeded_normal_(tensor, seed, name, residual_std if name.endswith(("proj.weight", "fc2.weight")) else std)


def check_config(cfg, positive: tuple[str, ...]) -> None:
    """The rules every built-in model's config shares, checked in its ``__post_init__``: the fields in
    ``positive`` are at least 1, ``n_heads`` divides ``d_model`` (with a size that would), and ``d_ff``
    defaults to ``4 * d_model``."""
    name = type(cfg).__name__
    for field in positive:
        if getattr(cfg, field) < 1:
            raise ValueError(f"{name}.{field} must be positive, got {getattr(cfg, field)}")
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}: "
                         f"try d_model={cfg.n_heads * max(1, round(cfg.d_model / cfg.n_heads))}")
    if cfg.d_ff is None:
        cfg.d_ff = 4 * cfg.d_model

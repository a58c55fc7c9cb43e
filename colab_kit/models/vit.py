"""ViT (Dosovitskiy et al. 2020, arXiv 2010.11929) in miniature: images cut into patches, a class token,
a pre-LN bidirectional encoder and a classification head on the class token.

The patch embedding is an ``nn.Linear`` on each flattened patch (the same map as a stride-p Conv2d);
the class token is a one-row table looked up with id 0 and the positions a table of
``patches + 1`` rows, so that every part is a Linear, an Embedding or a LayerNorm that a policy can
name (``colab_kit.policy.builtin.vit_policy``). No parallel code lives here.

The batch is ``(images [b, channels, H, W], labels [b])``; the loss is the mean cross-entropy::

    >>> cfg = ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, d_model=32, n_heads=4, n_layers=2)
    >>> ViT(cfg)(torch.zeros(3, 1, 8, 8)).shape
    torch.Size([3, 10])
    >>> ViT(cfg).patchify(torch.zeros(3, 1, 8, 8)).shape      # 16 patches of 1 x 2 x 2 values
    torch.Size([3, 16, 4])
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from .dropout import layout_invariant
from .layers import Block, check_config, init_by_name

__all__ = ["ViTConfig", "ViT"]


@dataclass
class ViTConfig:
    image_size: int = 8
    """Height and width of the (square) images."""
    patch_size: int = 2
    """Side of each square patch; must divide image_size."""
    channels: int = 1
    """Input channels."""
    num_classes: int = 10
    """Classes of the head."""
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
    seed: int = 0
    """Seed of the parameter initialisation."""

    def __post_init__(self):
        check_config(self, ("image_size", "patch_size", "channels", "num_classes", "d_model", "n_heads", "n_layers"))
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size={self.patch_size} must divide image_size={self.image_size}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image: the patches and the class token."""
        return self.n_patches + 1


class ViT(nn.Module):
    """``forward(images [b, c, H, W]) -> logits [b, num_classes]``; ``device="meta"`` builds shapes only."""

    def __init__(self, cfg: ViTConfig, device: str | torch.device | None = None):
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]), (torch.device(device) if device is not None else nullcontext()):
            self.patch = nn.Linear(cfg.channels * cfg.patch_size ** 2, cfg.d_model)
            self.cls = nn.Embedding.from_pretrained(torch.empty(1, cfg.d_model), freeze=False)
            self.pos = nn.Embedding.from_pretrained(torch.empty(cfg.seq_len, cfg.d_model), freeze=False)
            self.blocks = nn.ModuleList(Block(cfg, causal=False, pre_norm=True) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p)
        layout_invariant(self, seed=cfg.seed)  # each dropout numbered: masks that do not depend on the split

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """N(0, 0.02) matrices and tables, LayerNorm 1 and 0, zero biases, each from ``(cfg.seed, name)``."""
        return init_by_name(name, tensor, self.cfg.seed, 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers))

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """``[b, c, H, W] -> [b, patches, c p p]``, patches in row-major order."""
        b, c, h, w = images.shape
        p = self.cfg.patch_size
        if (c, h, w) != (self.cfg.channels, self.cfg.image_size, self.cfg.image_size):
            raise ValueError(f"images of shape [{c}, {h}, {w}] given to a ViT of "
                             f"[{self.cfg.channels}, {self.cfg.image_size}, {self.cfg.image_size}]")
        x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(self.patchify(images))
        cls = self.cls(torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device))
        x = torch.cat([cls, x], dim=1)
        return x + self.pos(torch.arange(x.shape[1], device=x.device))

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x[:, 0]))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        for block in self.blocks:
            x = block(x)
        return self.classify(x)

"""A small decoder-only transformer (GPT) that the engine can shard and stage.

Token and position embeddings, ``n_layers`` pre-LayerNorm blocks (causal
self-attention, then a GELU MLP; ``models.layers``) kept in ``model.blocks`` so that a
pipeline can cut between them, a final LayerNorm and an untied LM head. The model knows
nothing about parallelism: its policy (``colab_kit.policy.builtin.gpt_policy``) says what
each part is, and the parallel parts read that.

Parameters come from the config's seed alone (the global RNG is left as it
was), so every rank that builds ``GPT(cfg)`` holds identical weights. Each
parameter draws from its own generator, seeded with ``(cfg.seed, its name)``
(``GPT.init_parameter``), so any one of them can be rebuilt alone, in any order:
``GPT(cfg, device="meta")`` holds shapes only, and ``ck.boost`` builds from it just
this rank's shards, equal to the dense model's (``colab_kit.sharded_init``)::

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

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from .dropout import layout_invariant
from .layers import MLP, Attention, Block, check_config, init_by_name, seeded_normal_
from .moe import MoE, check_moe_config, moe_blocks, moe_loss

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
    n_experts: int = 0
    """Experts of each MoE layer (``colab_kit.models.moe``); 0: every block has the dense MLP."""
    top_k: int = 2
    """Experts each token is routed to (1 to n_experts)."""
    moe_every: int = 1
    """Block i's MLP is an MoE layer when ``(i + 1) % moe_every == 0`` (1: every block)."""
    d_expert: int | None = None
    """Inner size of one expert (and of one shared expert); d_ff when None."""
    shared_experts: int = 0
    """Experts every token goes through (one dense MLP of ``shared_experts * d_expert``), beside the routed ones."""
    router: str = "softmax"
    """Router scores: "softmax" (over the experts) or "sigmoid" (each on its own, DeepSeek-V3's)."""
    capacity_factor: float | None = None
    """None: dropless; c: each expert takes at most ceil(c * top_k * tokens / n_experts) of the batch's assignments."""
    aux_loss: float = 0.0
    """Weight of the Switch/GShard load-balancing loss (mean over the MoE layers)."""
    z_loss: float = 0.0
    """Weight of the router z-loss (mean over the MoE layers)."""
    router_bias_update: float = 0.0
    """DeepSeek's aux-loss-free balancing: the per-expert selection bias moves by this much after each step."""

    def __post_init__(self):
        check_config(self, ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"))
        check_moe_config(self)
        if self.n_experts and self.d_expert is None:
            self.d_expert = self.d_ff

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


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
            self.blocks = nn.ModuleList(Block(cfg, causal=True) for _ in range(cfg.n_layers))
            for j, i in enumerate(moe_blocks(cfg)):  # MoE layers where the config asks (none by default)
                self.blocks[i].mlp = MoE(cfg, layer=j)
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        layout_invariant(self, seed=cfg.seed)  # each dropout numbered: masks that do not depend on the split

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if not p.is_meta:  # a meta parameter is built later, from its name (colab_kit.sharded_init)
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
        residual = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        if ".experts." in name or name.endswith("score_bias"):  # stacked experts: biases 0, matrices as fc1 / fc2
            if name.endswith(("b_in", "b_out", "score_bias")):
                return tensor.zero_()
            return seeded_normal_(tensor, self.cfg.seed, name, residual if name.endswith("w_out") else 0.02)
        return init_by_name(name, tensor, self.cfg.seed, 0.02, residual)

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

    def aux_loss(self) -> torch.Tensor | float:
        """The MoE layers' auxiliary losses of the last forward (``colab_kit.models.moe.moe_loss``): what one
        process adds to the token loss, ``lm_loss(model(x), y) + model.aux_loss()``; 0.0 for a dense GPT."""
        return moe_loss(self)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

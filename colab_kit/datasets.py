"""Built-in learnable data: no download, deterministic, the same on every rank.

``SyntheticTokens`` makes arithmetic progressions modulo the vocabulary: each
sequence starts at a random token ``a`` and steps by a random stride ``k`` from
a small set, ``x_i = (a + i * k) mod V``. The first token is a guess (loss about
``ln V``); from the second on, the next token follows from the last two, so a
model that learns to read the stride drives the loss towards zero. A few dozen
steps of the small GPT show the loss fall clearly.

    >>> data = SyntheticTokens(vocab_size=16, seq_len=6, strides=(1, 3), seed=0)
    >>> inputs, targets = data.batch(step=0, batch_size=2)
    >>> inputs[0], targets[0]            # targets are inputs shifted by one token
    (tensor([12, 15,  2,  5,  8, 11]), tensor([15,  2,  5,  8, 11, 14]))

``batch(step, batch_size)`` depends only on (seed, step, batch_size): every rank
asks for the same global batch and takes its own share.
"""
from __future__ import annotations

import torch

__all__ = ["SyntheticTokens"]


class SyntheticTokens:
    def __init__(self, vocab_size: int = 64, seq_len: int = 32, strides: tuple[int, ...] = (1, 2, 3, 5),
                 seed: int = 0):
        if vocab_size < 2 or seq_len < 1:
            raise ValueError(f"need vocab_size >= 2 and seq_len >= 1, got {vocab_size} and {seq_len}")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.strides = torch.tensor(strides)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``(inputs, targets)``, both ``[batch_size, seq_len]`` int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=g)
        stride = self.strides[torch.randint(0, len(self.strides), (batch_size, 1), generator=g)]
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def __iter__(self):
        raise TypeError("SyntheticTokens is indexed by step: use data.batch(step, batch_size)")

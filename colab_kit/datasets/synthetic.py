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

__all__ = ["SyntheticTokens", "ByteText"]


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


class ByteText:
    """Real text as bytes (vocabulary 256): windows of ``seq_len + 1`` bytes of ``text``, by step.

    ``text``: a string, or a module whose source to read (``ByteText(json.decoder, 32)``: the standard
    library ships with Python, so no download). ``batch(step, b)`` is ``(inputs, next bytes)`` for a causal
    LM; ``masked(step, b, rate, mask_id)`` is a masked-LM batch: about ``rate`` of the bytes replaced by
    ``mask_id`` in the inputs and predicted (targets -100 elsewhere). Both depend only on (seed, step, b).

    >>> data = ByteText("abcdefghij" * 10, seq_len=4)
    >>> x, y = data.batch(0, 2)
    >>> bytes(x[0].tolist()).decode(), bytes(y[0].tolist()).decode()
    ('efgh', 'fghi')
    """

    def __init__(self, text, seq_len: int = 32, seed: int = 0):
        if not isinstance(text, str):
            import inspect
            text = inspect.getsource(text)
        self.data = torch.tensor(list(text.encode()), dtype=torch.long)
        if self.data.numel() <= seq_len + 1:
            raise ValueError(f"{self.data.numel()} bytes of text are too few for windows of {seq_len + 1}")
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, 256

    def _windows(self, step: int, batch_size: int, g: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (batch_size, 1), generator=g)
        return self.data[starts + torch.arange(self.seq_len + 1)]

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        w = self._windows(step, batch_size, g)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def masked(self, step: int, batch_size: int, rate: float = 0.15, mask_id: int = 1):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = self._windows(step, batch_size, g)[:, :-1].contiguous()
        picked = torch.rand(ids.shape, generator=g) < rate
        picked[:, 0] |= ~picked.any(dim=1)  # at least one target per row
        return torch.where(picked, mask_id, ids), torch.where(picked, ids, -100)

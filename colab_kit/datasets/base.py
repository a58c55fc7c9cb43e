"""What the map-style datasets share: a range of items, a held-out split, windows of tokens.

A dataset here is items ``start .. stop`` of a whole. ``split(fraction)`` cuts the last
``fraction`` of them off as a validation part; the two parts share the whole's storage
(nothing is copied) and never overlap:

    >>> ds = _Numbers(10)
    >>> train, val = ds.split(0.2)
    >>> len(train), len(val), val[0], val[-1]
    (8, 2, 8, 9)
"""
from __future__ import annotations

import copy
import operator

import torch

__all__ = []


class _Range:
    """Items ``_start .. _stop`` of a whole; a subclass sets ``_stop`` and defines ``_item(i)``."""

    _start = 0
    _stop = 0

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        i, n = operator.index(i), len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for {n} items")
        return self._item(self._start + i % n)

    def _item(self, i: int):
        raise NotImplementedError

    def split(self, fraction: float = 0.05):
        """``(train, val)``: val is the last ``round(fraction * len)`` items (at least one), train the
        rest. By index, so every machine cuts the same way; the parts share this dataset's storage."""
        n = len(self)
        k = max(1, round(n * fraction))
        if not 0 < fraction < 1 or k >= n:
            raise ValueError(f"split(fraction={fraction}) of {n} items leaves a part empty: "
                             f"use 0 < fraction < 1 with at least one item on each side (e.g. 0.05)")
        return self._part(self._start, self._stop - k), self._part(self._stop - k, self._stop)

    def _part(self, start: int, stop: int):
        part = copy.copy(self)
        part._start, part._stop = start, stop
        return part


class _Windows(_Range):
    """Non-overlapping windows of ``seq_len + 1`` tokens: window ``w`` holds tokens
    ``w*(seq_len+1) .. (w+1)*(seq_len+1)``; item ``w`` is ``(window[:-1], window[1:])``, int64.
    A subclass defines ``_tokens(a, b)`` (tokens ``a .. b`` as an int64 tensor)."""

    def _windows(self, n_tokens: int, seq_len: int, vocab_size: int, what: str) -> None:
        if seq_len < 1 or vocab_size < 2:
            raise ValueError(f"need seq_len >= 1 and vocab_size >= 2, got {seq_len} and {vocab_size}")
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self._start, self._stop = 0, n_tokens // (seq_len + 1)
        if self._stop < 1:
            raise ValueError(f"{what} has {n_tokens} tokens, too few for one window of seq_len + 1 = "
                             f"{seq_len + 1}: use a smaller seq_len or more data")

    def _tokens(self, a: int, b: int) -> torch.Tensor:
        raise NotImplementedError

    def _item(self, w: int):
        a = w * (self.seq_len + 1)
        ids = self._tokens(a, a + self.seq_len + 1)
        return ids[:-1], ids[1:]

    def unigram_entropy(self) -> float:
        """Entropy of this part's token frequencies, in nats per token: the loss of a model that only
        learned how often each token occurs. A model that reads context gets below it."""
        a, b = self._start * (self.seq_len + 1), self._stop * (self.seq_len + 1)
        counts = torch.zeros(self.vocab_size, dtype=torch.long)
        for c in range(a, b, 1 << 24):  # in chunks: a token file may be larger than memory
            counts += torch.bincount(self._tokens(c, min(b, c + (1 << 24))), minlength=self.vocab_size)
        p = counts[counts > 0].double() / counts.sum()
        return float(-(p * p.log()).sum())


class _Numbers(_Range):
    """0 .. n-1 (the example above)."""

    def __init__(self, n: int):
        self._stop = n

    def _item(self, i: int) -> int:
        return i

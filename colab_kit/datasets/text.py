"""Real text as windows of tokens: ``TextCorpus`` (bytes of files) and ``TokenFile`` (a token ``.bin``).

Both are map-style datasets of non-overlapping windows of ``seq_len + 1`` tokens; item ``i`` is
``(inputs, targets)``, two int64 tensors of ``seq_len`` tokens, targets the inputs shifted by one:

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.txt").write_text("abcdefghij")
    >>> ds = TextCorpus(folder, seq_len=4)          # windows "abcde" and "fghij"
    >>> len(ds)
    2
    >>> x, y = ds[1]
    >>> ds.decode(x), ds.decode(y)
    ('fghi', 'ghij')

``TextCorpus.stdlib(seq_len)`` reads the Python standard library's own sources, which every machine
with the same Python has byte for byte: real text with no download. Its ``unigram_entropy()``
is the loss a model reaches by learning byte frequencies alone (about 3.1 nats per byte for the
default first 4 MiB of Python 3.11's); a loss below it means the model reads context.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .base import _Windows

__all__ = ["TextCorpus", "TokenFile"]

_NOT_SOURCES = ("__pycache__", "site-packages", "dist-packages")
_TEST_DIRS = ("test", "tests", "idle_test")


def _files(paths, suffixes: tuple[str, ...], exclude: tuple[str, ...]):
    """The files named, and those under the directories named, in a fixed order: each directory's
    files sorted by name, then its subdirectories sorted by name (hidden and ``exclude`` ones skipped)."""
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        p = Path(p)
        if p.is_file():
            yield p
        elif p.is_dir():
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if d not in exclude and not d.startswith("."))
                yield from (Path(root, n) for n in sorted(names) if n.endswith(suffixes))
        else:
            raise FileNotFoundError(f"{p} is neither a file nor a directory")


class TextCorpus(_Windows):
    """The bytes of text files (vocabulary 256), as windows of ``seq_len + 1`` bytes.

    ``paths``: a file or directory, or a list of them; directories are read recursively, keeping
    files whose names end with one of ``suffixes`` and skipping directories named in ``exclude``.
    Files are joined in a fixed order (``_files``) and reading stops after ``max_bytes`` (None: all).
    The bytes live in one uint8 tensor, ``data``; ``files`` lists the files read.
    """

    def __init__(self, paths, seq_len: int = 32, *, suffixes=(".py", ".txt", ".md"), max_bytes: int | None = None,
                 exclude=_NOT_SOURCES):
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be positive or None (no cap), got {max_bytes}")
        chunks, total, self.files = [], 0, []
        for f in _files(paths, tuple(suffixes), tuple(exclude)):
            if max_bytes is not None and total >= max_bytes:
                break
            with open(f, "rb") as fh:
                chunk = fh.read(-1 if max_bytes is None else max_bytes - total)
            chunks.append(chunk)
            total += len(chunk)
            self.files.append(f)
        self.data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8) if total else \
            torch.zeros(0, dtype=torch.uint8)
        self._windows(total, seq_len, 256, f"the text in {paths}")

    @classmethod
    def stdlib(cls, seq_len: int = 32, *, max_bytes: int | None = 4 << 20, tests: bool = False) -> TextCorpus:
        """The ``.py`` sources of this Python's standard library (``sysconfig``'s "stdlib" directory,
        without site-packages, and without the test suites unless ``tests``): the first ``max_bytes``
        (4 MiB by default: fast to read; None for all, about 12 MB for Python 3.11)."""
        exclude = _NOT_SOURCES + (() if tests else _TEST_DIRS)
        return cls(sysconfig.get_paths()["stdlib"], seq_len, suffixes=(".py",), max_bytes=max_bytes, exclude=exclude)

    def _tokens(self, a: int, b: int) -> torch.Tensor:
        return self.data[a:b].long()

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """The UTF-8 bytes of ``text`` as int64 ids: ``encode("hé")`` is ``tensor([104, 195, 169])``."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    @staticmethod
    def decode(ids) -> str:
        """Text of byte ids (a tensor or list); bytes that are not valid UTF-8 show as U+FFFD."""
        return bytes(torch.as_tensor(ids).flatten().tolist()).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"TextCorpus({self.data.numel()} bytes from {len(self.files)} files, seq_len={self.seq_len}, "
                f"{len(self)} windows)")


class TokenFile(_Windows):
    """Pre-tokenised data: a flat binary file of token ids (``dtype``, uint16 by default, the layout
    of nanoGPT's ``train.bin``), read through ``numpy.memmap`` so only the windows asked for are read.

    ``vocab_size`` is required: a window holding an id outside ``0 .. vocab_size - 1`` raises
    ``ValueError`` when it is read (a wrong dtype or tokenizer shows up at once, not as an index error
    deep inside the embedding). ``TokenFile.write(path, ids)`` makes such a file:

    >>> import tempfile, os
    >>> path = TokenFile.write(os.path.join(tempfile.mkdtemp(), "t.bin"), range(10))
    >>> ds = TokenFile(path, seq_len=4, vocab_size=10)
    >>> ds[1]
    (tensor([5, 6, 7, 8]), tensor([6, 7, 8, 9]))
    >>> TokenFile(path, seq_len=4, vocab_size=8)[1]
    Traceback (most recent call last):
    ...
    ValueError: ...t.bin: token 8 at position 8 is outside vocab_size=8 (ids 0 .. 7): wrong vocab_size or dtype?
    """

    def __init__(self, path, seq_len: int, vocab_size: int, *, dtype="uint16"):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        if self.dtype.kind not in "iu":
            raise ValueError(f"dtype must be an integer type such as uint16 or int32, got {self.dtype}")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise ValueError(f"{path} has {size} bytes, not a whole number of {self.dtype} tokens: wrong dtype?")
        self._memmap: np.memmap | None = None
        self._windows(size // self.dtype.itemsize, seq_len, vocab_size, str(path))

    @staticmethod
    def write(path, ids, dtype="uint16") -> Path:
        """Write ``ids`` (a tensor, array or sequence of ints) to ``path`` as flat ``dtype`` values."""
        ids, dtype = np.asarray(ids).reshape(-1), np.dtype(dtype)
        info = np.iinfo(dtype)
        if ids.size and (ids.min() < info.min or ids.max() > info.max):
            raise ValueError(f"ids {ids.min()} .. {ids.max()} do not fit {dtype} ({info.min} .. {info.max})")
        ids.astype(dtype).tofile(path)
        return Path(path)

    def _tokens(self, a: int, b: int) -> torch.Tensor:
        if self._memmap is None:  # opened on first read: a pickled TokenFile carries its path, not its data
            self._memmap = np.memmap(self.path, dtype=self.dtype, mode="r")
        ids = torch.from_numpy(np.array(self._memmap[a:b], dtype=np.int64))
        bad = ((ids < 0) | (ids >= self.vocab_size)).nonzero()
        if len(bad):
            j = int(bad[0])
            raise ValueError(f"{self.path}: token {int(ids[j])} at position {a + j} is outside vocab_size="
                             f"{self.vocab_size} (ids 0 .. {self.vocab_size - 1}): wrong vocab_size or dtype?")
        return ids

    def __getstate__(self):
        return {**self.__dict__, "_memmap": None}

    def __repr__(self) -> str:
        return (f"TokenFile({str(self.path)!r}, seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
                f"{len(self)} windows)")

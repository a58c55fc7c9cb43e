"""``Digits``: scikit-learn's 8x8 handwritten digits, shipped inside the package (no download).

1797 grey images of the digits 0..9. Item ``i`` is ``(image, label)``: a float32 ``[1, size, size]``
image with pixels scaled to [0, 1] (the raw 0..16 divided by 16; not mean/std normalised) and an
int64 label. ``size`` upsamples bilinearly, e.g. to 16 for a ViT with patch 4 (16 patches):

    >>> ds = Digits(size=16)
    >>> image, label = ds[0]
    >>> image.shape, label, len(ds)
    (torch.Size([1, 16, 16]), tensor(0), 1797)

``ck.models.ViTConfig(image_size=ds.image_size, patch_size=4, channels=ds.channels,
num_classes=ds.num_classes, ...)`` fits it.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .base import _Range

__all__ = ["Digits", "load_digits"]


@functools.lru_cache(maxsize=1)
def _load_digits():
    """(images [1797, 1, 8, 8] float32 in [0, 1], labels int64), read from the CSV scikit-learn ships
    (``sklearn/datasets/data/digits.csv.gz``: 64 pixels 0..16 and the label per row, what its
    ``load_digits`` parses) without importing scikit-learn: that import (scipy with it) costs 1.5 s a
    process, paid by every rank that reads the digits."""
    import gzip
    import importlib.util
    import os

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = (os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
            if spec is not None and spec.origin is not None else None)
    if path is None or not os.path.exists(path):
        raise ImportError("Digits reads the 8x8 digits that ship with scikit-learn, which is not installed: "
                          "pip install scikit-learn")
    with gzip.open(path, "rt") as fh:
        rows = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(rows[:, :64].copy()).reshape(-1, 1, 8, 8) / 16.0
    return images, torch.from_numpy(rows[:, 64].astype(np.int64))


def load_digits():
    """All 1797 digits as ``(images [1797, 1, 8, 8] float32 in [0, 1], labels int64)``, read once per process."""
    return _load_digits()


class Digits(_Range):
    """The 8x8 digits as ``(image [1, size, size] float32 in [0, 1], label int64)``; ``size`` None keeps 8.
    ``images`` and ``labels`` hold them all; ``split(fraction)`` holds out the last images."""

    num_classes, channels = 10, 1

    def __init__(self, size: int | None = None):
        images, labels = _load_digits()
        size = 8 if size is None else size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int (e.g. 16 for a ViT with patch 4), got {size!r}")
        if size != 8:
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
        self.images, self.labels, self.image_size = images, labels, size
        self._stop = len(labels)

    def _item(self, i: int):
        return self.images[i], self.labels[i]

    def __repr__(self) -> str:
        return f"Digits({len(self)} images of {self.image_size}x{self.image_size})"

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

__all__ = ["Digits"]


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("Digits reads the 8x8 digits that ship with scikit-learn, which is not installed: "
                          "pip install scikit-learn") from e
    return _cached(load_digits)


@functools.lru_cache(maxsize=1)
def _cached(load_digits):
    d = load_digits()
    return torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0, torch.tensor(d.target, dtype=torch.long)


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

"""The precision step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): a 16-bit model, the loss in fp32."""
from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ..config import ParallelConfig
from . import loss_in_fp32, to_compute_dtype

__all__ = ["apply_precision"]


def apply_precision(module: nn.Module, config: ParallelConfig, loss_fn: Callable) -> Callable:
    """Mixed precision (``colab_kit.precision``): the model in bf16 or fp16, the loss in fp32.

    Needs: the materialised module (its parameters real) and the broadcast (one starting point in fp32).
    Leaves: the module's floating tensors 16-bit; returns the loss computed in fp32. The fp32 master
    weights are the data-parallel step's (they follow its pieces)."""
    to_compute_dtype(module, config.precision)
    return loss_in_fp32(loss_fn)

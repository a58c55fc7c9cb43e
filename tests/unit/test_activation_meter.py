"""``ActivationMeter`` counts each storage autograd saves once, by identity: a storage saved again after the
tensors first saved on it were dropped is the same storage. (A new storage at a freed one's address is another:
the allocator decides when that happens on CPU; fake tensors reuse identities every trace, and
tests/unit/test_moe_saves.py holds DeepSeek-V3's MoE layer, whose router drops a part of its graph, to the
meter's count on real tensors, twice.)"""
from __future__ import annotations

import torch

from colab_kit.measure import ActivationMeter


def test_a_storage_saved_again_counts_once():
    """A view of ``h`` is saved by a branch whose output is dropped (its saved tensors freed at once), then ``h``
    itself is saved: one storage of 4 KiB, not two."""
    x = torch.randn(32, 32, requires_grad=True)
    meter = ActivationMeter(exclude=[x])
    with meter.measure():
        h = x * 2  # saves nothing of h
        (h[:16] * h[:16]).sum()  # saves two views of h, dropped at once
        y = torch.sigmoid(h)  # saves its output (a new storage)
        z = y * h  # saves y and h again
    assert z.requires_grad
    assert meter.last == 2 * 32 * 32 * 4, meter.last

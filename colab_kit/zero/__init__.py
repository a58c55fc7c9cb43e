"""ZeRO over the dp axis (Rajbhandari et al. 2020, arXiv 1910.02054) and heterogeneous memory.

- ``buckets``: stages 1 and 2 (``ZeroBuckets``): optimizer states, then gradients, sharded;
  parameters whole on every rank. ``stage2``: stage 2 (``ZeroStage2``, a ``ZeroBuckets``):
  each gradient bucket exists only from its first gradient to the end of its reduce-scatter.
- ``stage3``: stage 3 (``ZeroParams``): parameters sharded too, each block's gathered just
  before it runs and freed after.

``ck.boost`` picks the part from ``config.zero``; every part has the interface the engine
and the pipeline executor drive (``arm``, ``finish``, ``zero``, ``remove``, ``nbytes``,
``build_optimizer``, ``sync_replicated``, ``gather_params``).
"""
from .buckets import ELEMENTWISE, ZeroBuckets, check_optimizer
from .stage2 import ZeroStage2

__all__ = ["ZeroBuckets", "ZeroStage2", "check_optimizer", "ELEMENTWISE"]

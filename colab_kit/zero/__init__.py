"""Data parallelism and ZeRO over the dp axis, dp x sp under sequence parallelism (Rajbhandari et al. 2020, arXiv
1910.02054), and heterogeneous memory. One class per stage, named for the ``config.zero`` it runs, all with one
declared interface (``GradientPart``, which the engine and the pipeline executor drive):

- ``stage0``: ``DataParallel``, plain data parallelism (DeepSpeed's stage 0): whole gradients all-reduced
  in buckets (the batch split over dp is ``datasets.loader.split_batch``, the rows ``ShardedLoader`` gives).
- ``stage1``: ``ZeroStage1``: optimizer states sharded; gradients reduce-scattered into the shard.
- ``stage2``: ``ZeroStage2`` (a ``ZeroStage1``): gradients sharded too, each bucket alive only from its
  first gradient to the end of its reduce-scatter.
- ``stage3``: ``ZeroStage3``: parameters sharded too, each block's gathered just before it runs and
  freed after.
- ``chunks``, ``offload``: where ZeRO's pieces live (device, host, or placed under a device budget).
- ``optimizer``: the user's optimizer (and LR scheduler) rebuilt over what this rank steps, group by group;
  which optimizers may step on pieces (``ELEMENTWISE``).

    >>> from colab_kit.zero import STAGES
    >>> [STAGES[z].__name__ for z in range(4)]
    ['DataParallel', 'ZeroStage1', 'ZeroStage2', 'ZeroStage3']
"""
from .stage0 import DataParallel, GradientPart
from .stage1 import ELEMENTWISE, ZeroStage1, check_optimizer
from .stage2 import ZeroStage2
from .stage3 import ZeroStage3

STAGES = {0: DataParallel, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
"""The gradient part of each ``config.zero``."""

__all__ = ["GradientPart", "DataParallel", "ZeroStage1", "ZeroStage2", "ZeroStage3", "STAGES", "check_optimizer",
           "ELEMENTWISE"]

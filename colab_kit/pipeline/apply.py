"""The pipeline step of ``ck.parallelize`` (``colab_kit.engine.parallelize``): this rank's stages."""
from __future__ import annotations

import torch.nn as nn

from ..config import Axis, ParallelConfig
from ..mesh import ProcessMesh
from .stage import split_model, tied_across_ranks

__all__ = ["apply_pipeline_split"]


def apply_pipeline_split(model: nn.Module, mesh: ProcessMesh, config: ParallelConfig, policy):
    """This pipeline rank's stages (``colab_kit.pipeline.stage``): ``pp * chunks`` stages cut on blocks.

    Needs: every step that changes a block (tensor, sequence, recompute), so each stage holds this rank's
    shards. Leaves ``(stages, tied)``: the stages this rank runs, and per weight tied across the first and
    last stage (a head tied to the token table) ``(shape, the parameter here or None)``."""
    tied = tied_across_ranks(model, config, policy)
    stages = split_model(model, config, mesh.rank(Axis.PP), policy)
    mine = {id(p) for st in stages for p in st.parameters()}
    return stages, [(tuple(t.shape), t if id(t) in mine else None) for t in tied]

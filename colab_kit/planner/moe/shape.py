"""The ``ModelShape`` of a mixture of experts and its memory walk, where the planner's callers have read them:
both live in ``colab_kit.memory.moe_shape`` (below the engine, whose ``memory_estimate()`` takes a Hugging Face
mixture of experts' layout share from the same walk as ``ck.estimate``)."""
from __future__ import annotations

from ...memory.moe_shape import (gpt_moe_of, gpt_moe_shape, hf_experts, hf_moe_shape, moe_memory, op_keeps_router,
                                 stage_split, tp_layer_params)

__all__ = ["gpt_moe_of", "gpt_moe_shape", "hf_experts", "hf_moe_shape", "moe_memory", "op_keeps_router", "stage_split",
           "tp_layer_params"]

"""The tensor part: this rank's blocks of each matrix (``apply_tensor_parallel``), and its rules: the modes' own
size checks, split_gather's layers, heads a split cannot take."""
from __future__ import annotations

from ..mesh import MeshLayout
from ..part import Build, NotYet, Part, memo, raised, rule
from . import plan_class
from .apply import apply_tensor_parallel
from .split_gather import SplitGather1D


@rule(model=False, not_yet=True)
def split_gather_1d(c, f):  # its plan splits 1D's layers only
    if c.sp_mode == "split_gather" and c.tp_mode != "1d":
        return NotYet(f"sp_mode='split_gather' with tp_mode={c.tp_mode!r}", "tp_mode='1d' with split_gather")
    return None


@rule(priced=True)
def attention_heads(c, f):
    if c.tp == 1 or not (f.latent or f.qk_norm):
        return None
    why = ("its multi-head latent attention (queries and keys-values through low-rank latents shared by every head, "
           "q_a_proj / kv_a_proj_with_mqa) has no tensor plan in this version" if f.latent else
           "it normalises q and k over all heads' features at once (q_norm / k_norm over num_heads x head_dim), "
           "which a split of the heads cannot compute locally")
    return (f"tp={c.tp} with {f.name}: {why}: set tp=1 (dp={c.dp * c.tp} runs the same ranks; ep splits the experts, "
            "sp the sequence)")


@rule(priced=True)
def split_gather_layers(c, f):
    if c.tp > 1 and c.sp_mode == "split_gather" and f.sizes is not None:
        return memo(f, ("split_gather_layers",), lambda: SplitGather1D.refused_layers(f.sizes))
    return None


@rule()
def tensor_sizes(c, f):
    if c.tp == 1 or f.sizes is None:
        return None
    return memo(f, ("tensor_sizes", c.tp, c.tp_mode, c.tp_depth, c.sp_mode), lambda: raised(
        lambda: plan_class(c.tp_mode, c.sp_mode).check(f.sizes, MeshLayout(c))))


RULES = (split_gather_1d, attention_heads, split_gather_layers, tensor_sizes)
"""This part's rules, in the order they are asked."""


def apply(b: Build) -> None:  # this rank's blocks of each matrix
    b.model, b.tp_plan = apply_tensor_parallel(b.model, b.mesh, b.config, b.policy, b.token_loss)


PART = Part("tensor", lambda c, _: c.tp > 1, RULES, apply)

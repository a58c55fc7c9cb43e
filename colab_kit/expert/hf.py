"""Expert parallelism for ``transformers``' fused experts (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...).

A Hugging Face MoE layer keeps its experts as 3D tensors (GPT-OSS: transposed, with biases, gate and up
interleaved, its own clamped activation: ``LAYOUTS``) and calls them with the router's choice::

    gate_up_proj [E, 2I, H]   down_proj [E, H, I]
    experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]
    expert e on row x: down_proj[e] @ (act(g) * u),  [g | u] = gate_up_proj[e] @ x
    out_t = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_t)

``HFExpertParallel`` takes its place with the same call. It holds this rank's ``E / ep`` experts (its slice of
both tensors, ``Shard(0)`` on ``ep``, cut by ``layer.slice_experts`` through ``sharded_init.cut``: one dense
tensor alive at a time) and runs the same math on the same rows, moved there by the all-to-all of
``colab_kit.expert.layer`` (``dispatch_combine``, steps 2-4 around step 3's math):

    1. the N x k (token, slot) assignments in expert-major order (``models.experts.dispatch``: a stable sort
       by expert), the token rows gathered in that order
    2. counts per expert -> all_to_all of the counts, all_to_all_v of the rows (``AllToAll``) to the ep
       rank holding each expert; received source-major, made expert-major (``expert_major``)
    3. each local expert on its run of rows: HF's SiLU-gated MLP with HF's weights and activation
    4. back to source-major, all_to_all_v back, each output put at its (token, slot) and summed over slots
       with the router's weights (``models.experts.combine``)

Worked example, E=4, ep=2, top-2, rank 1 (experts 2-3) with 3 tokens routed ``[[2, 0], [3, 2], [0, 1]]``:
expert-major order of the 6 assignments ``(0,1) (2,0) (2,1) (0,0) (1,1) (1,0)``: counts ``[2 1 2 1]``; rank
1 sends 3 rows to rank 0 (experts 0-1) and keeps 3 (experts 2-3), receives rank 0's rows for experts 2-3,
computes, and sends them back; its 3 tokens' outputs are then the one process's for these tokens.
The gradients of the local experts hold every ep rank's tokens (the backward of the all-to-all); the
expert-data-parallel group (``edp``) sums them (``colab_kit.zero.split``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Axis
from ..models import experts as _experts
from ..models.experts import _Contiguous, combine, dispatch
from ..models.moe_context import current
from .layer import dispatch_combine, slice_experts

__all__ = ["HFExpertParallel", "is_fused_experts", "fused_layout", "fused_experts", "hf_expert_compute"]

LAYOUTS = {"halves": ("gate_up_proj", "down_proj"),
           "interleaved": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
"""The fused forms: ``halves`` (Mixtral, Qwen, OLMoE, DeepSeek-V3: ``gate_up_proj [E, 2I, H]`` as ``x W^T``, gate
then up, ``act_fn(gate) * up``); ``interleaved`` (GPT-OSS: ``gate_up_proj [E, H, 2I]`` as ``x W + b``, gate and up
interleaved, the module's own ``_apply_gate``, ``down_proj [E, I, H]`` with a bias)."""


def fused_layout(module: nn.Module) -> str | None:
    """Which of ``LAYOUTS`` ``module`` holds (experts as dim 0 of each tensor, called as ``(hidden, top_k_index,
    top_k_weights)``), or None."""
    ps = module._parameters
    gu, down = ps.get("gate_up_proj"), ps.get("down_proj")
    if gu is None or down is None or gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != down.shape[0]:
        return None
    if set(ps) == set(LAYOUTS["halves"]) and hasattr(module, "act_fn") and gu.shape[1:] == (
            2 * down.shape[2], down.shape[1]):
        return "halves"
    if set(ps) == set(LAYOUTS["interleaved"]) and hasattr(module, "_apply_gate") and gu.shape[1:] == (
            down.shape[2], 2 * down.shape[1]):
        return "interleaved"
    return None


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds ``transformers``' fused experts in one of ``LAYOUTS``."""
    return fused_layout(module) is not None


def fused_experts(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, child name, experts)`` of the fused experts under ``layer`` (an MoE layer's path)."""
    return [(parent, name, child) for parent in layer.modules() for name, child in parent.named_children()
            if is_fused_experts(child)]


def hf_expert_compute(rows: torch.Tensor, counts: list[int], ws: Sequence[torch.Tensor], layout: str,
                      act) -> torch.Tensor:
    """Expert ``e`` (HF's math in ``layout``, weights ``ws`` in ``LAYOUTS`` order) on its run of ``counts[e]``
    rows of ``rows`` (expert-major): ``[M, H]``. An expert with no row runs on zero rows, so its slice of the
    weights still joins the graph. The gate/up halves layout runs as two ``torch._grouped_mm`` calls (HF's
    ``[E, out, in]`` weights transposed as views) where ``EXPERT_COMPUTE`` says so: 8 experts x 128 x 256 and
    1,024 rows, forward + backward, one CPU thread: 6.6 ms against 11.3 ms for the loop, equal to the bit."""
    if layout == "halves" and _experts.EXPERT_COMPUTE == "grouped_mm":  # one grouped GEMM per matrix (measured below)
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(rows, ws[0].transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return _Contiguous.apply(torch._grouped_mm(act(gate) * up, ws[1].transpose(1, 2), offs=offs))
    outs = []
    for e, part in enumerate(rows.split(counts)):
        if layout == "halves":
            gate, up = F.linear(part, ws[0][e]).chunk(2, dim=-1)
            outs.append(F.linear(act(gate) * up, ws[1][e]))
        else:
            outs.append(act(part @ ws[0][e] + ws[1][e]) @ ws[2][e] + ws[3][e])
    return torch.cat(outs) if outs else rows[:0]


class _OwnGate:
    """An interleaved experts module's own activation (GPT-OSS's clamped SwiGLU, ``_apply_gate``), called on a
    copy of its plain settings (``alpha``, ``limit``): no reference to the dense module and its tensors."""

    def __init__(self, experts: nn.Module):
        self.__dict__.update({k: v for k, v in vars(experts).items() if isinstance(v, (bool, int, float, str))})
        self.fn = getattr(type(experts), "_apply_gate")  # noqa: B009  # the class's function, called on this copy

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


class HFExpertParallel(nn.Module):
    """This rank's ``E / ep`` fused experts of one Hugging Face MoE layer and the all-to-all around them (see
    the module docstring); same call, same parameter names (``gate_up_proj``, ``down_proj``) as the HF module."""

    def __init__(self, experts: nn.Module, mesh, axis: str = Axis.EP, layer: int = 0):
        super().__init__()
        self.mesh, self.axis, self.layer = mesh, axis, layer
        self.layout = fused_layout(experts) or "halves"
        self.n = int(experts.get_parameter("gate_up_proj").shape[0])
        self.act = experts.act_fn if self.layout == "halves" else _OwnGate(experts)
        self.first, self.local = slice_experts(self, experts, LAYOUTS[self.layout], mesh, axis)
        self.last: dict = {}
        """The last forward's rows: ``send`` / ``recv`` per ep rank, and ``local`` rows per local expert."""
        self.traffic: dict = {}
        """The last forward's dispatch bytes: ``sent`` to / ``received`` from each ep rank; added to the records
        of MoE layer ``layer`` where its router wrote them (``colab_kit.models.hf_moe``, ``expert.records``)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        order, counts = dispatch(top_k_index, None, self.n)
        ws = [self.get_parameter(name) for name in LAYOUTS[self.layout]]

        def compute(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
            return hf_expert_compute(rows, local.tolist(), ws, self.layout, self.act)

        back, self.last, self.traffic = dispatch_combine(hidden_states[order // k], counts, compute, self.mesh,
                                                         self.axis)
        step = current()
        seen = step.seen.get(self.layer) if step is not None else None
        if seen is not None and "sent" not in seen:  # a recomputed forward: recorded already
            seen.update(self.traffic)
        return combine(back, order, top_k_weights.to(back.dtype)).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        shape = tuple(self.get_parameter("gate_up_proj").shape)
        return (f"experts {self.first}..{self.first + self.local - 1} of {self.n} (gate_up_proj {shape}) "
                f"over {self.axis}={self.mesh.size(self.axis)}")

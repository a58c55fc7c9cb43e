"""What one MoE layer of a Hugging Face mixture of experts saves for backward, read off the layer itself.

Each family writes its router and experts its own way (Mixtral renormalises its top-k weights in fp32 and hands
them on in fp32; Qwen3-MoE and OLMoE cast them back; DeepSeek-V3 routes in fp32 on an fp32 copy of the input,
with group-limited top-k and masks; GPT-OSS softmaxes the top-k logits; experts are SwiGLU with gate and up in
one tensor, or GPT-OSS's clamped, biased, interleaved form; Qwen2-MoE gates its shared expert). Rather than a
formula per family, ``trace_moe_layer`` runs the layer (``block.mlp``: router, routed experts as transformers
runs them, shared experts) on fake CPU tensors (``memory.fake``: shapes only, nothing allocated, the CPU kernels'
choices, as ``estimator.traced_activations`` traces a dense model) for 2 and 4 tokens in fp32 and in bf16, and
keeps what a token adds and what the layer holds whatever the tokens (the experts' offsets, a router weight's fp32
copy). The meter's rule (``ActivationMeter``): each storage once, parameters never; the layer's
input is left out, since the block's count holds it (the norm's output, the matmuls' input).

Inside the engine a router with Hugging Face's load-balancing loss (``models.hf_moe.router_loss``) also keeps its
softmax ``e N E`` and its probability sums ``e E`` (``aux``; counted in the compute dtype: a router whose logits
are fp32 keeps ``(4 - e) N E`` more). A layer the fake tensors cannot run (transformers' eager experts loop sizes
its rows with ``nonzero``) is counted by the MoE GPT's table instead (``memory.moe_shape``).

Worked example, a Mixtral layer of h 32, 4 experts of width 64, top-2, in bf16 (e = 2), per token: the router
``4 E + 8 k + 4 + 4 k`` (fp32 softmax, top-k indices, the sum and the top-k values it divides) = 44; the experts,
``k`` rows each: three int64 indices, the gathered row ``e h``, gate and up ``2 e f``, the SiLU's output and the
product ``2 e f``, the row's weight (fp32, 4) and the expert's output ``e h``: ``2 (24 + 64 + 256 + 256 + 4 + 64)
= 1,336``; with the router's 44, 1,380 bytes a token, and with the engine's loss ``e E`` = 8 more, 1,388
(``tests/unit/test_moe_saves.py``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SelectiveCheckpointContext, checkpoint, create_selective_checkpoint_contexts

from ..expert.hf import fused_layout
from ..models import experts as _experts
from ..recompute.op import MATMULS, kept_through_hooks, op_policy
from .fake import per_token, saved_bytes

__all__ = ["MoELayerSaves", "trace_moe_layer"]

class _PerOp(nn.Module):
    """``layer`` run as per-op recomputation runs it inside its block (``recompute.op``): under the block's policy,
    the ``before`` matmuls attention ran already counted, the kept outputs passed through the meter's hooks."""

    def __init__(self, layer: nn.Module, before: int):
        super().__init__()
        self.layer, self.before = layer, before

    def forward(self, x):
        policy = op_policy()
        ctx = SelectiveCheckpointContext(is_recompute=False)
        for _ in range(self.before):  # attention's matmuls: the count the MoE layer starts from
            policy(ctx, torch.ops.aten.mm.default)
        out = checkpoint(self.layer, x, use_reentrant=False,
                         context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        return kept_through_hooks(out, policy.kept)


@dataclass(frozen=True)
class MoELayerSaves:
    """One MoE layer's saved bytes, ``(e, per token, fixed)`` for compute dtypes of e bytes (4: fp32, 2: bf16 and
    fp16), traced (``trace_moe_layer``); ``op`` the same under per-op recomputation (() where not traced);
    ``experts`` and ``aux`` for the engine's load-balancing terms."""

    traced: tuple
    experts: int
    aux: bool = False
    op: tuple = ()
    ep_kept: int = 0
    """Under ep > 1 the engine runs this family's experts one matmul pair an expert (``expert.hf.hf_expert_compute``:
    GPT-OSS's interleaved layout, or any layout where ``EXPERT_COMPUTE`` is not grouped GEMMs), and per-op
    recomputation counts them, which ``op`` (transformers' own experts) does not see: every expert keeps the output
    of the same one of its two, this many values a routed row (gate and up ``2 f``, or down ``h``, by the parity of
    the matmuls ahead of it: attention's, the router's, a shared expert's); 0 for grouped GEMMs."""

    def bytes(self, tokens: int, e: int, mode: str = "none") -> int:
        """What the layer saves for ``tokens`` tokens on a rank in a compute dtype of ``e`` bytes, with nothing
        recomputed ("none"; "selective" recomputes attention's core only) or per op ("op": the engine's load-balancing
        softmax is recomputed with the rest)."""
        rows = self.op if mode == "op" else self.traced
        per, fixed = next((p, f) for b, p, f in rows if b == (4 if e >= 4 else 2))
        aux = (e * tokens * self.experts + e * self.experts) if self.aux and mode != "op" else 0
        return tokens * per + fixed + aux


_DTYPES = ((4, torch.float32), (2, torch.bfloat16))


def trace_moe_layer(layer, hidden: int, experts: int, aux: bool = False, before: int | None = None) -> MoELayerSaves:
    """``MoELayerSaves`` of ``layer`` (an MoE block's MLP, on the meta device or not: only its shapes are read),
    called on ``[1, tokens, hidden]``; under per-op recomputation too where ``before`` (the matmuls its block runs
    ahead of it: attention's) is given."""
    shape = lambda n: (1, n, hidden)  # noqa: E731
    traced = tuple((e, *per_token(layer, shape, dtype)) for e, dtype in _DTYPES)
    op: tuple = ()
    if before is not None:
        try:
            op = tuple((e, *per_token(_PerOp(layer, before), shape, dtype)) for e, dtype in _DTYPES)
        except Exception:  # noqa: BLE001  # the policy's run fails on fake tensors: per-op by the walk's rule
            op = ()
    return MoELayerSaves(traced=traced, experts=experts, aux=aux, op=op, ep_kept=_ep_kept(layer, hidden, before))


def _ep_kept(layer: nn.Module, hidden: int, before: int | None) -> int:
    """``MoELayerSaves.ep_kept`` of ``layer``: which of an expert's two matmuls per-op keeps under ep (the first
    where the matmuls ahead of it, ``before`` and the layer's own before its experts, are even in number), its
    output's width."""
    experts = next((m for m in layer.modules() if fused_layout(m) is not None), None)
    if before is None or experts is None:
        return 0
    layout = fused_layout(experts)
    if not (layout == "interleaved" or _experts.EXPERT_COMPUTE != "grouped_mm"):
        return 0
    ahead: list[int] = []
    try:
        saved_bytes(_Counted(layer, ahead.append), (1, 2, hidden), torch.float32)
    except Exception:  # noqa: BLE001  # a layer the count cannot run on fake tensors: its traces stand without it
        return 0
    if not ahead:
        return 0
    gate_up: Any = experts.gate_up_proj
    first = int(gate_up.shape[2 if layout == "interleaved" else 1])  # gate and up: 2 f
    return first if (before + ahead[0]) % 2 == 0 else hidden


class _Counted(nn.Module):
    """``layer`` run with its matmuls counted (those ``recompute.op`` counts); ``report(count)`` when its experts
    start (a function: a meta twin of this module calls the same one)."""

    def __init__(self, layer: nn.Module, report):
        super().__init__()
        self.layer, self.report = layer, report

    def forward(self, x):
        seen = [0]

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen[0] += func in MATMULS
                return func(*args, **(kwargs or {}))

        experts = next(m for m in self.layer.modules() if fused_layout(m) is not None)
        hook = experts.register_forward_pre_hook(lambda *_: self.report(seen[0]))
        try:
            with Count():
                return self.layer(x)
        finally:
            hook.remove()

"""The software a cluster runs, in the at-scale cost model's terms: kernels, fusion and overlap, each a choice
a real training stack makes.

``Hardware`` is the node (what the GPUs compute and move); ``Stack`` is what runs on it. The same node prices
differently under Megatron-LM of 2021 (attention unfused, its fused LayerNorm and bias kernels), DeepSpeed's
ZeRO-3 of 2021 (one all-gather per parameter tensor), Megatron-Core of 2024 (FlashAttention, Transformer
Engine's fused norms and RoPE, the distributed optimizer's all-gather under the next forward, tp collectives
under their GEMMs) and colab_kit's own engine (torch's SDPA, eager PyTorch elsewhere, the parameters'
all-gather after the update). A preset carries a stack (``Hardware.stack``; ``colab_kit`` by default:
what ``ck.boost`` runs) and ``hw.with_stack(...)`` gives the same node under another, one object per
combination, so ``price``'s cache keeps working.

=================  ===========================================================================================
field              what it prices (``planner.cluster.price``, ``planner.cluster.compute``)
=================  ===========================================================================================
attention          "flash": FlashAttention-2's FLOPs at ``Hardware.attention_efficiency``; "unfused": the
                   scores through HBM (Megatron-LM 2021)
elementwise        "eager": one kernel per PyTorch op (a Llama block's RMSNorm upcast to fp32, RoPE's slices
                   and concatenation, SiLU and its product, ``repeat_kv``'s copies); "fused": one kernel per
                   norm, rotary, activation and bias-dropout-add (Megatron's fused kernels, Transformer
                   Engine, ``torch.compile``)
param_gather       ZeRO 1-2's all-gather of the updated parameters: "exposed" after the step (colab_kit,
                   DeepSpeed), or "overlapped" under the next step's first forward, bucket by bucket
                   (Megatron-Core ``--overlap-param-gather``, FSDP's prefetch); at least one block's bucket
                   stays exposed
tp_overlap         1D tp collectives cut into chunks and run under the GEMMs they feed (Megatron-Core
                   ``--tp-comm-overlap``, Transformer Engine's userbuffers): exposed ``max(comm / tp,
                   comm - the block's GEMMs)``; off: all exposed
zero3_gather       ZeRO-3's parameter gathers: "block", one flat all-gather per block (FSDP, colab_kit's
                   chunks); "tensor", one per parameter tensor (DeepSpeed's stage 3 of 2021), each paying a
                   ring's latency, which grows with the ranks
checkpoint         full recomputation: "early_stop", torch's non-reentrant checkpoint (colab_kit, torchtitan's
                   activation checkpointing), which stops replaying once the last tensor backward needs is
                   rebuilt; "whole", the block's whole forward again (Megatron's and DeepSpeed's checkpoint
                   functions). What early stop leaves out depends on ``linear`` (``replayed_by_full``)
linear             how the parallel linear layers are written: "function", autograd Functions, which save
                   their inputs only once their whole forward ran (colab_kit's tp layers and zero-bubble
                   ``DeferredLinear``, Megatron's): early stop still runs the last GEMM, and a 2D/2.5D/3D
                   block's collectives; "module", ``nn.Linear`` on DTensors (torchtitan): the last GEMM saved
                   before it runs, left out
=================  ===========================================================================================

Contention: communication hidden behind compute is taken to slow that compute by nothing. NCCL's kernels
occupy some of the GPU's SMs (one per channel) and stream their bytes through HBM while the GEMMs run, so
this is optimistic, by an amount not measured here; it is stated in every estimate's assumptions.

Worked example, the stacks of ``STACKS``::

    >>> sorted(STACKS)
    ['colab_kit', 'deepspeed-2021', 'megatron-core', 'megatron-lm-2021', 'torchtitan']
    >>> STACKS["megatron-core"].param_gather, STACKS["colab_kit"].param_gather
    ('overlapped', 'exposed')
"""
from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["ATTENTION", "STACKS", "Stack", "plain_left_out", "replayed_by_full", "stack"]

ATTENTION = ("flash", "unfused")
"""The kernels attention's core can be priced as (``Stack.attention``)."""
_CHOICES = {"attention": ATTENTION, "elementwise": ("eager", "fused"), "param_gather": ("exposed", "overlapped"),
            "tp_overlap": (False, True), "zero3_gather": ("block", "tensor"), "checkpoint": ("early_stop", "whole"),
            "linear": ("function", "module")}


@dataclass(frozen=True)
class Stack:
    """What a training stack runs (module docstring); hashable and compared by value."""

    name: str = "colab_kit"
    attention: str = "flash"
    elementwise: str = "eager"
    param_gather: str = "exposed"
    tp_overlap: bool = False
    zero3_gather: str = "block"
    checkpoint: str = "early_stop"
    linear: str = "function"
    source: str = ("colab_kit's engine: torch's F.scaled_dot_product_attention, eager PyTorch elsewhere, ZeRO 1-2 "
                   "gather the parameters after the update, tp collectives not overlapped, ZeRO-3 one gather per block")

    def __post_init__(self):
        for f, allowed in _CHOICES.items():
            if getattr(self, f) not in allowed:
                raise ValueError(f"Stack.{f} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, f)!r}")

    def note(self) -> str:
        """One line of an estimate's assumptions: the stack's choices and where they were read."""
        choices = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self) if f.name in _CHOICES)
        return (f"stack {self.name}: {choices} ({self.source}); communication hidden behind compute taken to slow "
                f"it by nothing (NCCL's SMs and HBM traffic during overlap not priced)")


STACKS = {s.name: s for s in (
    Stack(),
    Stack("megatron-lm-2021", attention="unfused", elementwise="fused", checkpoint="whole",
          source="Megatron-LM 2021 (Narayanan et al., arXiv 2104.04473; Korthikanti et al., arXiv 2205.05198): batched "
                 "attention products and a fused scaled-masked softmax, fused bias-GELU and bias-dropout-add, apex "
                 "LayerNorm; gradients all-reduced after backward"),
    Stack("deepspeed-2021", attention="unfused", elementwise="fused", zero3_gather="tensor", checkpoint="whole",
          source="DeepSpeed ZeRO stage 3 of 2021 (Rajbhandari et al., arXiv 2104.07857) on Megatron-LM's kernels: "
                 "each partitioned parameter gathered by an all-gather of its own (partition_parameters.py)"),
    Stack("megatron-core", elementwise="fused", param_gather="overlapped", tp_overlap=True, checkpoint="whole",
          source="Megatron-Core with Transformer Engine (2024): flash attention, fused RMSNorm / RoPE / SwiGLU / "
                 "bias-dropout-add, distributed optimizer with --overlap-grad-reduce --overlap-param-gather, "
                 "--tp-comm-overlap"),
    Stack("torchtitan", param_gather="overlapped", linear="module",
          source="torchtitan (Liang et al. 2024, arXiv 2410.06511) without torch.compile: FSDP2 prefetching each "
                 "block's all-gather, SDPA flash attention, eager PyTorch elementwise (torch.compile: "
                 "elementwise='fused')"))}
"""Named stacks; ``Stack(...)`` or ``dataclasses.replace(STACKS[name], ...)`` makes others."""


def replayed_by_full(config, stack: Stack) -> tuple[bool, float]:
    """``(last GEMM left out, share of the forward's tp collectives replayed)`` by full recomputation of a block
    under ``config`` on ``stack``. A whole-forward checkpoint: ``(False, 1.0)``. torch's early stop (the last
    tensor backward needs is fc2's input): fc2 is left out where it is a plain module's GEMM (no tp and no
    zero-bubble schedule in colab_kit, any 1D layout in torchtitan); of the tp collectives 1D leaves fc2's
    all-reduce out (half replayed), split_gather its reduce-scatter (three of four), and 2D/2.5D/3D blocks,
    autograd Functions whole, replay everything::

        >>> from colab_kit.config import ParallelConfig
        >>> replayed_by_full(ParallelConfig(tp=2), STACKS["colab_kit"]), replayed_by_full(ParallelConfig(),
        ...                                                                                  STACKS["colab_kit"])
        ((False, 0.5), (True, 1.0))
        >>> replayed_by_full(ParallelConfig(tp=4, tp_mode="2d"), STACKS["colab_kit"])
        (False, 1.0)
    """
    if stack.checkpoint != "early_stop" or (config.tp > 1 and config.tp_mode != "1d"):
        return False, 1.0
    plain = stack.linear == "module" or (config.tp == 1 and plain_left_out(config, stack))
    share = 1.0 if config.tp == 1 else 0.75 if config.sp_mode == "split_gather" else 0.5
    return plain, share


def plain_left_out(config, stack: Stack) -> bool:
    """Whether full recomputation leaves out a plain ``nn.Linear`` run last in a block (fc2 without tp, an MoE
    block's shared expert): under torch's early stop, unless the zero-bubble schedules' ``DeferredLinear``, an
    autograd Function, stands in for it (``stack.linear == "function"``)."""
    zero_bubble = config.pp > 1 and config.schedule in ("zb-h1", "zb-v")
    return stack.checkpoint == "early_stop" and not (zero_bubble and stack.linear == "function")


def stack(name_or_stack) -> Stack:
    """A stack by name, or the ``Stack`` given; a ``KeyError`` naming the stacks otherwise."""
    if isinstance(name_or_stack, Stack):
        return name_or_stack
    if name_or_stack not in STACKS:
        raise KeyError(f"unknown stack {name_or_stack!r}: choose from {', '.join(STACKS)} or pass a Stack(...)")
    return STACKS[name_or_stack]

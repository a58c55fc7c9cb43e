"""The host's floor under a step: eager PyTorch dispatches every operator from the CPU, one at a time.

A GPU runs a step's kernels no faster than the host can issue them. Each operator of an eager step costs the
host some microseconds (Python, torch's dispatcher, autograd, the kernel's launch) whatever its size, so a
small model's step is bound by the host, not by the GPU: the 125M GPT of the GPU check dispatches 2,123
operators a step (``bench/op_count.py``). ``price`` adds the part of this floor the rank's own GPU work does
not cover, as ``breakdown["host"]`` (``max(0, host - (the rest - bubble))``: the host runs ahead while the GPU
is busier, and waits through a pipeline's bubble as the GPU does).

Operators a step dispatches on the fullest rank, counted by ``colab_kit.observe.ops.count_ops`` on the engine
(one rank, AdamW, ``tests/ranks/test_host_ops.py`` recounts them), per model family and precision::

    ops = fixed + per_microbatch m + blocks (per_block + (per_block_microbatch + recompute[mode]) m)

``per_block`` is paid once a step (the optimizer and the precision's copies, per parameter tensor), the
rest per microbatch (forward, backward, the replayed forward of the recompute mode). The number depends on
the program, not on the widths: a family is counted once at a tiny width. Worked example, the GPT check's
125M GPT (12 blocks, bf16, one microbatch, no recompute)::

    >>> from colab_kit.planner.shape import ModelShape
    >>> s = ModelShape(layers=12, hidden=768, heads=12, vocab=25600, seq=1024)
    >>> ops_per_step(s, blocks=12, microbatches=1, precision="bf16", recompute="none")
    2116

(``bench/op_count.py`` counts the engine's step of that GPT at full size, with ``foreach=True``.)
Priced at ``op_seconds(hw, shape)`` an operator: on a measured preset (``curve_fit.measured_preset``), the
host seconds an operator of the family's own training step, timed at a tiny width on the GPU's machine
(``bench/gpu_curves.py``'s ``program`` sweep: ``Hardware.family_op_seconds``); a family not timed takes its
kin's figure (Llama the GPT's, a Hugging Face MoE the built-in MoE's, and back), else ``Hardware.op_seconds``:
5 us assumed on a datasheet preset, the launch of a tiny ``add_`` where only that was measured. Only the
engine's own stack is counted (``stack="colab_kit"``, and torchtitan's eager one alike); other stacks fuse
their elementwise work and may capture CUDA graphs, so no floor is priced for them. The counts are those of
one rank without parallel axes; tp, sp, pp and ZeRO add their collectives' operators, which are not counted:
the floor stays a lower bound.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPS", "OpCount", "family", "host_seconds", "op_seconds", "ops_per_step"]


@dataclass(frozen=True)
class OpCount:
    """Operators of one eager step (the module's formula) for one family and precision."""
    fixed: int
    per_microbatch: int
    per_block: int
    per_block_microbatch: int
    recompute: tuple  # extra per block and microbatch: (selective, op, full)

    def ops(self, blocks: int, microbatches: int, recompute: str) -> int:
        extras = {"none": 0, "selective": self.recompute[0], "op": self.recompute[1], "full": self.recompute[2]}
        if recompute not in extras:
            raise ValueError(f"recompute {recompute!r}: one of {', '.join(extras)}")
        extra = extras[recompute]
        return (self.fixed + self.per_microbatch * microbatches
                + blocks * (self.per_block + (self.per_block_microbatch + extra) * microbatches))


OPS = {  # family -> {"fp32" | "mixed" (bf16, fp16)} -> counts (tests/ranks/test_host_ops.py recounts them)
    "gpt": {"fp32": OpCount(56, 57, 24, 93, (10, 67, 61)), "mixed": OpCount(77, 59, 72, 93, (10, 67, 61))},
    "gpt-moe": {"fp32": OpCount(64, 57, 27, 229, (10, 138, 132)), "mixed": OpCount(85, 59, 79, 237, (10, 138, 132))},
    "llama": {"fp32": OpCount(52, 96, 18, 211, (10, 137, 128)), "mixed": OpCount(65, 105, 54, 219, (10, 141, 132))},
    "hf-moe": {"fp32": OpCount(60, 94, 18, 333, (10, 166, 159)), "mixed": OpCount(72, 103, 55, 350, (10, 171, 164))},
}
"""Counted on: the built-in ``GPT`` (``gpt``) and its mixture of experts (``gpt-moe``), Hugging Face's
``LlamaForCausalLM`` (``llama``: every gated, rotary block, Mistral and Qwen alike) and ``MixtralForCausalLM``
(``hf-moe``: every Hugging Face mixture of experts; the engine runs its experts grouped, so the count does not
grow with the experts). AdamW with ``foreach=True``, as torch picks it for CUDA tensors (on CPU it loops over
the tensors one by one: three times the optimizer's operators). "mixed" is counted in bf16; fp16 adds the
loss scaler's few operators a step, not counted."""

EAGER_STACKS = ("colab_kit", "torchtitan")


def family(shape) -> str:
    """The counted family ``shape`` is priced as (``OPS``)."""
    if shape.experts:
        return "gpt-moe" if shape.name == "GPT-MoE" else "hf-moe"
    return _dense(shape)


def _dense(shape) -> str:
    """The family of ``shape``'s dense blocks."""
    return "llama" if shape.gated else "gpt"


def ops_per_step(shape, blocks: int, microbatches: int, precision: str, recompute: str,
                 moe: int | None = None) -> int:
    """Operators one eager step dispatches on a rank holding ``blocks`` of ``shape``'s blocks (the module's
    formula), ``moe`` of them MoE blocks (default: all of a mixture of experts' share, ``moe_blocks``); its dense
    blocks at its dense family's counts."""
    kind = "fp32" if precision == "fp32" else "mixed"
    count = OPS[family(shape)][kind]
    if not shape.experts:
        return count.ops(blocks, microbatches, recompute)
    if moe is None:
        moe = round(blocks * len(shape.moe_blocks) / shape.layers)
    dense = OPS[_dense(shape)][kind]
    return count.ops(moe, microbatches, recompute) + (dense.ops(blocks - moe, microbatches, recompute)
                                                      - dense.ops(0, microbatches, recompute))


KIN = {"llama": "gpt", "hf-moe": "gpt-moe", "gpt": "llama", "gpt-moe": "hf-moe"}
"""The family whose measured figure a family takes where its own was not timed: the built-in and the Hugging
Face one of the same kind (dense, mixture of experts), each for the other."""


def op_seconds(hw, shape) -> tuple[float, str]:
    """``(seconds, which)``: the host's seconds an operator of ``shape``'s step on ``hw``, and which figure it is
    (the family's own, its kin's, or ``op_seconds``)::

        >>> from dataclasses import replace
        >>> from colab_kit.planner.cluster.hardware import HARDWARE
        >>> from colab_kit.planner.shape import ModelShape
        >>> hw = replace(HARDWARE["8xH200-SXM"], family_op_seconds={"gpt": 2e-5})
        >>> op_seconds(hw, ModelShape(layers=2, hidden=64, heads=2, vocab=256, seq=64, gated=True))
        (2e-05, "gpt (measured for llama's kin)")
    """
    name = family(shape)
    for which in (name, KIN.get(name)):
        if which in hw.family_op_seconds:
            return hw.family_op_seconds[which], which if which == name else f"{which} (measured for {name}'s kin)"
    return hw.op_seconds, "op_seconds"


def host_seconds(shape, config, blocks: int, hw, recompute: str, moe: int | None = None) -> float:
    """The host's seconds to dispatch one step on the fullest rank (0 for a stack that is not eager PyTorch);
    ``recompute``: the mode (``compute.recompute_mode``)."""
    if hw.stack.name not in EAGER_STACKS:
        return 0.0
    per_op = op_seconds(hw, shape)[0]
    return ops_per_step(shape, blocks, config.microbatches, config.precision, recompute, moe) * per_op

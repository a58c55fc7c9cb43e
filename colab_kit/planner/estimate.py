"""``ck.estimate``: one config's step time, memory per rank and MFU, on this machine or a cluster preset.

The function ``ck.plan`` ranks its candidates by, opened to any config the engine runs. On a preset
(``hardware="dgx-a100-80gb"``, ..., ``planner.cluster.hardware.HARDWARE``) the step is priced by the at-scale model
(``planner.cluster.price.price``: GEMMs at the preset's achievable efficiency, collectives on the node hierarchy,
overlap that hides at most the compute beside it, the schedule's own bubble; calibrated on Megatron-LM's
Table 1, docs/estimate.md); on ``hardware="this machine"`` by the cost model measured here (``planner.local.step``).
The memory is the engine's own estimate (``memory.estimator.config_estimate``, what ``engine.memory_estimate()``
reports) of a GPT of the model's widths, its model states scaled to the model's true parameter count.

Worked example, a Llama 3 70B-shaped model read from its Hugging Face config (built on the meta device: no
weights), ZeRO-1, Megatron's sequence parallelism and selective recomputation on 32 DGX H100 nodes::

    >>> import colab_kit as ck
    >>> from transformers import LlamaConfig
    >>> est = ck.estimate(LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    ...                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
    ...                   ck.ParallelConfig(dp=8, tp=8, pp=4, microbatches=64, zero=1, precision="bf16",
    ...                   sp_mode="split_gather", recompute="selective"), batch=512, seq=8192,
    ...                   hardware="8xH100-SXM")                                            # doctest: +SKIP
    >>> print(est)                                                                          # doctest: +SKIP
    LlamaForCausalLM 70.6B, dp=8 x pp=4 x tp=8 (1d) = 256 ranks, split_gather, 1f1b x 64 microbatches, zero=1,
    bf16, selective recompute on 8xH100-SXM, batch 512 x 8192: 19.2 s/step, 218,577 tokens/s, 411 TFLOP/s per
    GPU, MFU 41.6%
      memory per rank (fullest): params 4.3 GiB, grads 4.3 GiB, optimizer 3.2 GiB, activations 40.6 GiB; with
      overhead 59.2 GiB, fits in 75 GiB
      breakdown: compute 14.2 s, comm:tp 4.03 s, bubble 824 ms, comm:dp 120 ms, comm:pp 51.3 ms, optimizer 3.2 ms

That prices colab_kit's engine (``stack="colab_kit"``: torch's SDPA, eager PyTorch elsewhere, tp collectives
exposed), which would refuse this layout for a Llama (split_gather splits no RMSNorm or rotary embedding yet,
``engine.rules``): priced as the widths read, and the assumptions say so. ``stack="megatron-core"`` (fused
kernels, tp communication under its GEMMs, the parameters' all-gather under the next forward) gives 13.9 s:
compute 12.6 s, comm:tp 0.50 s. ``attention="unfused"``, Megatron-LM 2021's kernels with the scores through HBM,
gives 31.1 s and 25.5 s of compute. docs/estimate.md lists what the model leaves out.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

from ..config import ConfigError, ParallelConfig
from ..memory.estimator import config_estimate
from ..memory.formulas import auto_placed, host_share, optimizer_states
from ..memory.saves import BlockSaves
from ..models import GPT, GPTConfig
from .cluster.hardware import ATTENTION, HARDWARE, Hardware
from .cluster.price import price
from .local.constants import LOCAL, constants as measured
from .local.step import step_seconds
from .moe.local import moe_step_seconds
from .moe.shape import gpt_moe_of, moe_memory
from .shape import ModelShape, shape_and_facts
from ..engine.parts import refusals

__all__ = ["Estimate", "estimate", "memory_of", "hardware_of", "priced", "gpt_of"]

_KEYS = ("params", "grads", "optimizer", "activations")


@dataclass
class Estimate:
    """What ``ck.estimate`` says of one config (every figure per step, the memory per rank)."""

    shape: ModelShape
    config: ParallelConfig
    batch: int
    seq: int
    hardware: str
    step_seconds: float
    memory: dict
    """Bytes of the fullest rank, the keys of ``engine.memory()``: params, grads, optimizer, activations, and
    "device" / "host" each of those four."""
    overhead_bytes: int
    """What the device holds beyond the tensors: the allocator's cached blocks, CUDA context, collective buffers."""
    device_capacity: int
    breakdown: dict
    """Seconds by part: compute, bubble, exposed ``comm:<axis>``, optimizer."""
    assumptions: list = field(default_factory=list)
    """Every figure taken from the preset (or the measured constants), with its source."""
    collectives: dict = field(default_factory=dict)

    @property
    def device_bytes(self) -> int:
        """Bytes on one device: the tensors and the overhead."""
        return sum(self.memory["device"].values()) + self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.device_capacity

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.seq / self.step_seconds

    @property
    def model_flops(self) -> float:
        """FLOPs of one step by the model's count: 6N per token plus attention, recomputation not counted."""
        return self.batch * self.seq * self.shape.flops_per_token(self.seq)

    @property
    def peak_flops(self) -> float:
        """The device's datasheet dense peak at the config's precision (MFU's denominator)."""
        return _hardware(self.hardware).peak(self.config.precision) if self.hardware != LOCAL else self._local_peak

    _local_peak: float = 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: ``model_flops / (step_seconds * ranks * peak_flops)``."""
        return self.model_flops / (self.step_seconds * self.config.world_size * self.peak_flops)

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per device (recomputation not counted)."""
        return self.model_flops / self.step_seconds / self.config.world_size / 1e12

    def __str__(self) -> str:
        gib = 2 ** 30
        mem = ", ".join(f"{k} {self.memory[k] / gib:.1f} GiB" for k in _KEYS)
        parts = ", ".join(f"{k} {_secs(v)}" for k, v in sorted(self.breakdown.items(), key=lambda kv: -kv[1]) if v > 0)
        fits = "fits" if self.fits else "does NOT fit"
        active = f" ({self.shape.active_params / 1e9:.1f}B active)" if self.shape.experts else ""
        return (f"{self.shape.name} {self.shape.params / 1e9:.1f}B{active}, {self.config.describe()} on "
                f"{self.hardware}, "
                f"batch {self.batch} x {self.seq}: {_secs(self.step_seconds)}/step, "
                f"{self.tokens_per_second:,.0f} tokens/s, {self.tflops_per_gpu:.0f} TFLOP/s per GPU, "
                f"MFU {100 * self.mfu:.1f}%\n"
                f"  memory per rank (fullest): {mem}; with overhead {self.device_bytes / gib:.1f} GiB, "
                f"{fits} in {self.device_capacity / gib:.0f} GiB\n"
                f"  breakdown: {parts}")

    def _repr_html_(self) -> str:
        import html
        return "<pre>" + html.escape(str(self)) + "</pre>"


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{1e3 * s:.3g} ms"


def _hardware(name) -> Hardware:
    return name if isinstance(name, Hardware) else HARDWARE[name]


def hardware_of(hardware) -> Hardware | str:
    """A preset by name (case and the old ``8xA100-80GB`` spellings accepted), a ``Hardware``, or ``LOCAL``;
    an unknown name is refused with the presets."""
    if isinstance(hardware, Hardware) or hardware == LOCAL:
        return hardware
    if isinstance(hardware, str) and hardware in HARDWARE:
        return HARDWARE[hardware]
    import difflib

    near = difflib.get_close_matches(str(hardware), list(HARDWARE), n=1, cutoff=0.5) if isinstance(hardware, str) \
        else []
    raise ConfigError(f"unknown hardware {hardware!r}: " + (f"did you mean {near[0]!r}? " if near else "")
                      + f"choose a preset ({', '.join(sorted(HARDWARE))}), {LOCAL!r} (the constants measured here), "
                      "or a planner.cluster.hardware.Hardware of your own")


def gpt_of(shape: ModelShape) -> GPTConfig:
    """The GPT of ``shape``'s widths that the engine's memory estimate lays out (a gated MLP's three matrices
    as a GPT MLP of 1.5 times its width: its parameters; what a block saves is ``shape.block_saves()``'s)."""
    d_ff = shape.d_ff * 3 // 2 if shape.gated else shape.d_ff
    return GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, d_model=shape.hidden, n_heads=shape.heads,
                     n_layers=shape.layers, d_ff=d_ff)


FIT_ACTIONS = 2048
"""The largest ``pp x microbatches`` whose zb-v plan ``memory_of`` fits to the model's FLOPs, as the engine does
(pp 16 and 128 microbatches: about a second on a CPU)."""


def memory_of(shape: ModelShape, config: ParallelConfig, batch: int, optimizer: str = "adamw", *,
              gpt: GPTConfig | None = None, fit: bool = True) -> dict:
    """The engine's estimate for the fullest rank of ``config`` (``config_estimate`` of ``gpt_of(shape)``),
    its model states scaled to ``shape.params`` (grouped-query attention, no position table, a tied head), its
    activations what the shape's blocks save as the engine runs them (``shape.block_saves()``: a Llama's
    RMSNorm in fp32, SwiGLU, grouped-query attention, rotary tables; ``memory.saves``).

    A pipeline of more than ``2 pp`` microbatches holds at its peak what one of ``2 pp`` microbatches of the
    same rows holds (every schedule but gpipe has reached its steady state by then: tests/unit/test_estimate.py
    walks the plans to check it), so the schedule is walked that far at most: a 64-stage pipeline of 512
    microbatches is priced in milliseconds, not minutes. zb-v's plan is the one fitted to the model's FLOPs, as
    the engine runs it, with ``fit`` where ``pp x microbatches`` is at most ``FIT_ACTIONS`` (about a second to
    fit), walked at the step's own microbatches: the V reaches its steady state later, its weight stores (each
    Linear's input and output gradient) outweighing a forward's saves; fitted it holds up to 6% more than at unit
    costs after ``2 pp`` (pp 4-16, 8 pp microbatches), and at unit costs it holds 1% more from ``3 pp`` on.
    Otherwise, and in the at-scale search (``fit=False``: fitting a deep V takes seconds, and a ``3 pp`` walk
    slows the search), at unit costs and ``2 pp``: up to 6% short of the fitted plan the engine runs
    (tests/unit/test_estimate.py); the search walks a zb-v candidate within 10% of the budget fitted
    (``search.ZBV_MARGIN``, up to ``search.SEARCH_FIT_ACTIONS``)."""
    m = config.microbatches
    walk_fitted = config.schedule == "zb-v" and fit and config.pp * m <= FIT_ACTIONS
    cap = 2 * config.pp
    if config.pp > 1 and config.schedule != "gpipe" and m > cap and not walk_fitted:
        rows = batch // (config.dp * m)
        config, batch = config.replace(microbatches=cap), config.dp * cap * rows
    if shape.experts:  # a mixture of experts: its own walk (memory.moe_shape.moe_memory)
        return moe_memory(shape, config, batch, optimizer)
    gpt = gpt or gpt_of(shape)
    fitted = config.schedule != "zb-v" or walk_fitted
    mem = _cached_estimate(gpt, config, batch, optimizer, shape.seq, fitted, shape.block_saves())
    scale = shape.params / _gpt_params(gpt)
    if abs(scale - 1) < 1e-12:
        return {**mem, "device": dict(mem["device"]), "host": dict(mem["host"])}
    device, host = mem["device"], mem["host"]
    out = {k: round(mem[k] * scale) if k != "activations" else mem[k] for k in _KEYS}
    share = {k: (host[k] / mem[k] if mem[k] else 0.0) for k in _KEYS}
    out["host"] = {k: round(out[k] * share[k]) for k in _KEYS}
    out["device"] = {k: out[k] - out["host"][k] for k in _KEYS}
    del device
    return out


def _cached_estimate(gpt: GPTConfig, config: ParallelConfig, batch: int, optimizer: str, seq: int,
                     fitted: bool, saves: BlockSaves | None = None) -> dict:
    return _estimate_of(dataclasses.astuple(gpt), config, batch, optimizer, seq, fitted, saves)


@functools.lru_cache(maxsize=4096)
def _estimate_of(gpt: tuple, config: ParallelConfig, batch: int, optimizer: str, seq: int, fitted: bool,
                 saves: BlockSaves | None) -> dict:
    return config_estimate(GPTConfig(*gpt), config, batch, optimizer, seq=seq, fitted=fitted, saves=saves)


def _gpt_params(gpt: GPTConfig) -> int:
    return ModelShape.of(gpt).params


def _check(config, batch, shape, facts, uneven: bool = False, local: bool = True) -> list[str]:
    """Refuse what ``ck.estimate`` cannot price: a batch that does not split, and every rule of the engine's parts
    (``engine.rules``, the rules ``boost`` and ``ck.plan`` follow) but the pipeline's even split with
    ``uneven``, and, at a preset (not ``local``), the rules ``priced`` (a layout the engine cannot lower for this
    model, priced as the shape reads): those come back as assumptions."""
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"ck.estimate takes a ParallelConfig, got {type(config).__name__}: "
                          f"e.g. ck.ParallelConfig(dp=8, tp=8, pp=4, microbatches=32)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be a positive whole number of sequences per step, got {batch!r}")
    if batch % (config.dp * config.microbatches):
        raise ConfigError(f"a global batch of {batch} sequences does not split over dp x microbatches = "
                          f"{config.dp} x {config.microbatches}: use a batch that is a multiple of "
                          f"{config.dp * config.microbatches}, or fewer microbatches")
    notes = []
    for part, rule, why in refusals(config, facts):
        if uneven and rule.name == "pipeline_stages":
            continue  # priced with its fullest stage (estimate's assumptions say so)
        if rule.priced and not local:
            notes.append(f"not runnable by colab_kit's engine, priced as the model's widths read (the {part.name} "
                         f"part's rule {rule.name}): {why}")
            continue
        raise ConfigError(why)
    return notes


def estimate(model, config: ParallelConfig, batch: int, *, seq: int | None = None, hardware="8xA100-80GB",
             precision: str | None = None, optimizer: str = "adamw", policy=None,
             constants: dict | None = None, uneven_stages: bool = False, attention: str | None = None,
             stack=None) -> Estimate:
    """Step time, memory per rank and MFU of ``config`` training ``model`` on a global ``batch`` of sequences.

    ``model``: a ``GPTConfig``, a built-in model, a Hugging Face config or model (built on the meta device:
    no weights), any model with a policy, or a ``ModelShape``. ``hardware``: a preset name
    (``planner.cluster.hardware.HARDWARE``; default the DGX A100 80GB the calibration table ran on), a ``Hardware``,
    or ``"this machine"`` (the constants measured here, ``constants=`` to give them). ``precision``
    overrides the config's. ``uneven_stages`` (a preset only): price a pipeline whose blocks do not split
    evenly over its stages (DeepSeek-V3's 61 over 16), the last ``layers % stages`` stages one block more; the
    engine splits them evenly, so such a layout is priced, not runnable. ``attention`` (a preset only):
    "flash" or "unfused", the kernel attention's core is priced as, over the preset's own (``Hardware.attention``:
    "flash" on every preset, what the engine runs; "unfused" for Megatron-LM 2021's runs). ``stack`` (a preset
    only): the software priced on the node, a name of ``planner.cluster.stack.STACKS`` ("colab_kit", the engine, by
    default; "megatron-core", "torchtitan", "megatron-lm-2021", "deepspeed-2021") or a ``Stack``; ``attention``
    then overrides its kernel. Nothing runs: no process, no tensor."""
    shape, facts = shape_and_facts(model, policy, seq)
    seq = shape.seq
    if precision is not None:
        config = config.replace(precision=precision)
    hw = hardware_of(hardware)
    if stack is not None:
        hw = _with_stack(hw, stack)
    if attention is not None:
        hw = _with_attention(hw, attention)
    if uneven_stages and hw == LOCAL:
        raise ConfigError("uneven_stages prices a layout the engine cannot run: give a cluster preset, e.g. "
                          "hardware='8xH800-SXM', or stages that split the blocks evenly")
    refused = _check(config, batch, shape, facts, uneven_stages, hw == LOCAL)
    try:
        optimizer_states(optimizer)
    except ValueError as exc:  # an unknown optimizer, refused before anything is priced
        raise ConfigError(str(exc)) from None
    memory = memory_of(shape, config, batch, optimizer)
    if config.offload == "auto" and isinstance(hw, Hardware):  # the placement under the preset's usable memory
        memory = auto_placed(memory, hw.usable_bytes)
    if hw == LOCAL:
        consts = constants if constants is not None else measured(ranks=config.world_size)
        if shape.experts:  # the MoE GPT of its widths (planner.moe.local)
            gpt = model.cfg if isinstance(model, GPT) else model if isinstance(model, GPTConfig) else gpt_moe_of(shape)
            seconds, parts, counts = moe_step_seconds(dataclasses.replace(gpt, seq_len=seq), config, batch, consts,
                                                      memory, optimizer)
        else:
            gpt = dataclasses.replace(gpt_of(shape), seq_len=seq)
            seconds, parts, counts = step_seconds(gpt, config, batch, consts, memory, optimizer)
        est = Estimate(shape, config, batch, seq, LOCAL, seconds, memory, 0, _local_capacity(), parts,
                       ["constants measured on this machine (planner.local.constants)"], counts)
        est._local_peak = consts["matmul"]["flops_per_s"]
        return est
    assert isinstance(hw, Hardware)
    est = priced(shape, config, batch, hw, memory, optimizer)
    est.assumptions.extend(refused)
    if uneven_stages and shape.layers % (config.pp * config.chunks):
        est.assumptions.append(f"{shape.layers} blocks over {config.pp * config.chunks} stages: the fullest "
                               f"{-(-shape.layers // (config.pp * config.chunks))} (the engine needs an even split)")
    return est


def _with_attention(hw, attention: str) -> Hardware:
    """``hw`` with attention priced as ``attention`` (``Hardware.with_attention``: one object per preset and
    kernel, so ``price``'s cache keeps working); refused on this machine's measured constants."""
    if attention not in ATTENTION:
        raise ConfigError(f"attention={attention!r}: choose one of {', '.join(ATTENTION)} (flash: FlashAttention, what "
                          f"the engine runs on GPUs; unfused: Megatron-LM 2021's kernels)")
    if hw == LOCAL:
        raise ConfigError("attention= picks the kernel a cluster preset is priced with; the constants measured on "
                          "this machine price what ran here: give hardware='8xH100-SXM' (or another preset)")
    return hw.with_attention(attention)


def _with_stack(hw, stack) -> Hardware:
    """``hw`` under ``stack`` (``Hardware.with_stack``); refused on this machine's measured constants and for
    a name that is no stack."""
    if hw == LOCAL:
        raise ConfigError("stack= picks the software a cluster preset is priced with; the constants measured on "
                          "this machine price what ran here: give hardware='8xH100-SXM' (or another preset)")
    try:
        return hw.with_stack(stack)
    except KeyError as exc:
        raise ConfigError(str(exc).strip('"')) from None


def priced(shape: ModelShape, config: ParallelConfig, batch: int, hw: Hardware, memory: dict,
           optimizer: str = "adamw") -> Estimate:
    """The ``Estimate`` of ``config`` on a preset with ``memory`` (``memory_of``'s): ``ck.estimate`` and the
    at-scale ``ck.plan`` both make theirs here, so the plan ranks by exactly what ``ck.estimate`` says."""
    share = host_share(memory)
    p = price(shape, config, batch, hw, seq=shape.seq, optimizer=optimizer, host_share=share)
    notes = list(p.assumptions)  # (the attention kernel's line among them)
    if config.offload == "auto":
        notes.append(f"offload='auto': {share:.0%} of the model states on the host, what does not "
                     f"fit beside the activations in the preset's {hw.usable_bytes / 2 ** 30:.1f} GiB usable "
                     f"(memory.formulas.auto_placed)")
    return Estimate(shape, config, batch, shape.seq, hw.name, p.step_seconds, memory, hw.device_bytes - hw.usable_bytes,
                    hw.device_bytes, dict(p.breakdown), notes, dict(p.collectives))


def _local_capacity() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

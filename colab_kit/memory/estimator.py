"""The estimate of one rank's memory under any ``ParallelConfig``: the one estimator that
``engine.memory_estimate()`` reports beside its measurements and ``ck.plan`` ranks candidates by.

``colab_kit.memory`` holds the formulas for one rank's share (``model_state_bytes``: the ZeRO
paper's; ``activation_bytes``: what each GPT op saves, with 1D tensor parallelism and
split_gather). This file says what that share *is* for a config, from the pieces of ``memory.layout``:

- ``part_params``: parameters per rank of the embeddings, one block, ``ln_f`` and the head, in
  each tensor mode, split the way the layers in ``colab_kit.tensor`` split them (1D: Megatron's
  column/row halves, vocabulary over tp; 2D/2.5D: q x q blocks, the token table V/q x h/q, the
  position table and every bias and LayerNorm h/q, the same on each 2.5D depth layer; 3D: the
  weights q**3 ways, the token table V/q^2 x h/q, biases, LayerNorms and positions q ways);
- ``stage_params``: those parts summed over the stages each pipeline rank holds
  (``pipeline.stage.stage_layers`` and the schedule's placement, ``PipelinePlan.stages_of``);
- ``layout_activations``: one microbatch's saved bytes on one stage in the config's layout
  (tokens split over the tensor plan's batch axes and over sp; 2D/3D LayerNorms save their
  centred input and product, 3D Linears their gathered input and weight);
- ``pipeline_peak``: the most bytes a pipeline rank holds at once, walking its own actions in
  the schedule's order (F adds a microbatch's stage bytes, B or W frees them), which is what the
  executor's meter counts.

``config_estimate`` puts them together for one pipeline rank, or for the fullest one.

Worked example, the demo GPT (vocab 64, seq 32, d_model 64, 4 heads, 4 layers) with AdamW on
4 ranks, a global batch of 16 rows::

    config            params/rank  activations/rank (estimate; measured by engine.memory())
    tp=4 (1d)         221,440 B    4,018,436 B      (4,019,456)
    tp=4 (2d)         215,808 B    2,514,180 B      (2,514,944)
    pp=4, m=4, 1f1b   224,512 B    rank 0 holds 4 microbatches of stage 0 (the fullest)
"""
from __future__ import annotations

import weakref

from .experts import moe_estimate
from .fake import saved_bytes
from .formulas import model_state_bytes, placed
from .moe_shape import hf_experts, moe_memory
from .saves import BlockSaves
from .shape import ModelShape
from .layout import (layout_activations, part_params, pipeline_peak, rank_params, stage_params,  # noqa: F401
                     walks)
from ..config import ParallelConfig
from ..models import GPTConfig
from ..models import experts as _experts
from ..models.moe import has_experts
from ..precision import compute_dtype
from ..recompute.apply import apply_recompute
from ..sharded_init import meta_twin
from ..tensor import model_sizes

__all__ = ["part_params", "stage_params", "rank_params", "layout_activations", "pipeline_peak", "config_estimate",
           "traced_activations", "traced_mode", "gpt_like", "model_activations"]


def config_estimate(model, config, batch: int, optimizer="adamw", *, seq: int | None = None,
                    pp_rank: int | None = None, n_params: int | None = None, host_share: float | None = None,
                    fitted: bool = True, saves=None) -> dict:
    """Estimated bytes on one rank of ``config`` training a GPT (``model``: its GPTConfig) on a
    global ``batch`` of rows per step: the keys of ``engine.memory()`` with "device" and "host".

    ``pp_rank`` picks the pipeline rank (None: the one with the most parameters plus activations);
    ``n_params`` overrides the parameter count (another model); ``seq`` defaults to the model's; ``fitted``
    (``pipeline_peak``): zb-v's plan fitted to the model's FLOPs, as the engine runs it, or at unit costs;
    ``saves`` (``memory.saves.BlockSaves``): what a block of another architecture saves (the GPT's when None).

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.models import GPTConfig
    >>> g = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=4)
    >>> e = config_estimate(g, ParallelConfig(tp=4, tp_mode="2d"), 16)
    >>> e["params"], e["activations"]
    (215808, 2514180)
    """
    if getattr(model, "n_experts", 0) and n_params is None:  # a mixture of experts: its own count
        return moe_estimate(model, config, batch, optimizer, seq=seq, pp_rank=pp_rank, host_share=host_share)
    seq = model.seq_len if seq is None else seq
    rows = batch // (config.dp * config.microbatches)
    params = stage_params(model, config) if n_params is None else [n_params] * config.pp
    if config.pp > 1:
        acts = pipeline_peak(model, config, rows, seq, fitted=fitted, saves=saves)
    else:
        acts = [layout_activations(model, config, rows, seq, layers=model.n_layers, saves=saves)]
    states = [model_state_bytes(p, optimizer, config.precision, config.zero_ranks, config.zero, config.offload)
              for p in params]  # ZeRO shards over dp x sp
    totals = [sum(s.values()) + a for s, a in zip(states, acts)]
    r = max(range(config.pp), key=totals.__getitem__) if pp_rank is None else pp_rank
    return placed({**states[r], "activations": acts[r]}, config.zero, config.offload, host_share)


def traced_activations(model, shape, dtype=None, precision: str = "fp32", policy=None, recompute: str = "none") -> int:
    """Bytes ``model``'s forward saves for backward on an input of ``shape`` (``dtype``: int64 ids when
    None), measured with fake CPU tensors (``memory.fake.saved_bytes``: shapes and dtypes, no storage, no compute,
    the CPU kernels' choices, e.g. SDPA's): the dense model in one process. The meter's rule
    (``memory.ActivationMeter``): each storage once, parameters never. Equal to the measurement of the
    real model for GPT, ViT, Llama and a user's model here. ``recompute`` "op" or "full" (with the model's
    ``policy``): traced with its blocks recomputed as the engine runs them (``recompute.apply_recompute`` on a meta
    copy), what each block keeps then passing the meter's hooks as in the engine."""
    hf = getattr(model, "config", None)
    if recompute in ("op", "full") or getattr(hf, "output_router_logits", False):
        model = meta_twin(model)
        if getattr(hf, "output_router_logits", False):  # the engine's step turns Hugging Face's own load-balancing
            model.config.output_router_logits = False  # loss off (models.hf_moe: the routers count the batch's)
        if recompute in ("op", "full"):
            apply_recompute(model, policy, ParallelConfig(recompute=recompute))
    return saved_bytes(model, tuple(shape), compute_dtype(precision), input_dtype=dtype, hidden=False)


def traced_mode(model, policy, config) -> str:
    """The recomputation ``model_activations`` traces ``model`` under for ``config``: a mixture of experts under
    per-op or full recomputation as it recomputes (its MoE layers keep almost nothing of their own there, where a GPT
    block's share would keep its MLP's fc1: 1.6-6x the measurement), "none" otherwise (the forward traced once, the
    GPT's share of what each mode keeps applied)."""
    experts = bool(getattr(policy, "experts", ())) or has_experts(model)
    return config.recompute if experts and config.recompute in ("op", "full") else "none"


def gpt_like(model, policy):
    """The GPTConfig of the same widths as ``model`` (its policy's sizes): what the layout formulas scale by."""
    sizes = model_sizes(model, policy)
    heads = sizes.n_heads or 1
    vocab = next(iter(sizes.outputs.values()), sizes.d_model)
    return GPTConfig(vocab_size=vocab, seq_len=max(sizes.seq_len, 1), d_model=sizes.d_model, n_heads=heads,
                     n_layers=len(policy.block_list(model)), d_ff=sizes.d_ff)


def model_activations(model, policy, config, shape, dtype=None, pp_rank=None, traced: int | None = None) -> int:
    """Activations per rank for any model with a policy: its dense forward traced on the meta device for
    the global batch ``shape`` (``traced_activations``), times the share of a GPT of the same widths that
    ``config``'s layout keeps on the rank (``config_estimate``'s layout formulas: dp and microbatch rows,
    the tensor mode's split, sp's tokens, the pipeline's peak), its blocks counted as the model's own
    architecture saves (``BlockSaves.of_module``: a Llama's RMSNorm, SwiGLU and grouped-query attention). Within
    5% of what the engine measures for BERT, ViT, GPT-2, Llama and a user's model (0.97-1.02,
    ``tests/ranks/test_models_memory.py``), the loss's saved tensors added (the engine takes it on fp32 logits:
    the log-softmax over the outputs, the targets; outside the traced forward, 3% of the dense tests' activations,
    up to 30% of a small recomputed mixture of experts'; a user's ``loss_fn`` is counted as a cross-entropy over
    the same outputs, which the usual ones keep too). A mixture of experts under per-op or full recomputation is
    traced as it recomputes (``traced_mode``), and the layout's share taken at that recomputation. A Hugging Face
    mixture of experts takes its share from its own walk (``memory.moe_shape.moe_memory``, the one ``ck.estimate``
    prices it by: its MoE layers whole on every tp rank, its experts' tokens under ep, each pipeline rank's stages),
    not a GPT block's: 0.97-1.00 of the measurement where the GPT's share gave 0.72-0.88 under tp and ep
    (``tests/ranks/test_hf_activations.py``). Worked example, Mixtral (2 blocks, hidden 32, 4 experts) on 8 rows of
    16 tokens, the one-process trace plus loss 1,067,556 B::

        tp=2       walk share 0.937 (attention halved, MoE layers whole)  ->  1,000,240 B a rank (measured 1,004,480)
        dp=2 ep=2  walk share 0.500 (half the rows, balanced routing)

    ``traced``: the
    trace, where the caller has it, made under ``traced_mode(model, policy, config)``."""
    gpt = gpt_like(model, policy)
    # what this architecture's dense blocks save (a mixture of experts: a Hugging Face one's share from its own walk
    # below, another's, the built-in MoE GPT's as a user wraps it, from the GPT's blocks)
    saves = None if policy.experts or has_experts(model) else BlockSaves.of_module(model, policy)
    tokens = policy.sequence and len(shape) > 1
    seq = shape[1] if tokens else gpt.seq_len
    if seq > gpt.seq_len:
        import dataclasses
        gpt = dataclasses.replace(gpt, seq_len=seq)
    batch = shape[0]
    mode = traced_mode(model, policy, config)
    alone = ParallelConfig(precision=config.precision, recompute=mode)
    if hf_experts(model):  # a Hugging Face mixture of experts: its own walk's share (MoE layers whole on a tp rank)
        walk = _walk_of(model, seq)
        one = moe_memory(walk, alone, batch)["activations"]
        here = moe_memory(walk, config, batch, pp_rank=pp_rank)["activations"]
    else:
        one = config_estimate(gpt, alone, batch, seq=seq, saves=saves)["activations"]
        here = config_estimate(gpt, config, batch, seq=seq, pp_rank=pp_rank, saves=saves)["activations"]
    if traced is None:  # ``traced``: the trace, when the caller already has it (the planner, per mode)
        traced = traced_activations(model, shape, dtype, config.precision, policy, mode)
    n = batch * (seq if tokens and policy.loss == "tokens" else 1)  # the loss's rows: every token's, or a row's label
    loss = 4 * n * gpt.vocab_size + 8 * n + 4  # outside the traced forward: the fp32 log-softmax, targets, weight
    return round((traced + loss) * here / max(one, 1))


_WALKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {(seq, how its experts compute): its ModelShape}: read once per model (a Hugging Face MoE layer is
traced to read it), however often the engine reports (``engine.memory_estimate()``) or a dry run's ranks ask.
What per-op recomputation keeps of GPT-OSS's experts under ep follows ``models.experts.EXPERT_COMPUTE``
(``MoELayerSaves.ep_kept``), so it is part of the key."""


def _walk_of(model, seq: int) -> ModelShape:
    """The ``ModelShape`` of a Hugging Face mixture of experts at sequence ``seq`` (``memory.moe_shape``), cached."""
    shapes, key = _WALKS.setdefault(model, {}), (seq, _experts.EXPERT_COMPUTE)  # read now: a user may set it
    if key not in shapes:
        shapes[key] = ModelShape.of(model, seq=seq)
    return shapes[key]

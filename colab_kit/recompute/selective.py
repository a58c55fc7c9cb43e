"""Selective recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198, section 4.2): attention's core runs again in backward.

``ParallelConfig(recompute="selective")``. The core is what mixes tokens and holds no weight:
``softmax(q k^T / sqrt(d)) v``, with the attention-probability dropout between (the paper's QK^T,
softmax, dropout and attention over V). Its activations grow with ``t^2`` per head where a kernel keeps
the scores (the paper's ``5 a s / h`` term of ``s b h (34 + 5 a s / h)`` bytes a layer) and its FLOPs are a
small share of the block's, so keeping its inputs and recomputing the rest is nearly free. Where the core
is a fused kernel (``F.scaled_dot_product_attention``: the built-in models, a Hugging Face model under
"sdpa") no score is kept in the first place: the kernel keeps q, k, v, its output and a log-sum-exp
per row and head, and only the log-sum-exp is the core's alone (the output is ``proj``'s input, the same
storage), so selective saves ``4 N a / tp`` bytes a block. Eager attention (a Hugging Face model with
attention dropout, ``colab_kit.models.dropout.HF_ATTENTION``, or "eager") keeps the scores, the
probabilities, the dropout's mask and the dropped probabilities: selective drops all of them.

How, in each mode (``recompute_attention``, the recompute step of ``ck.parallelize``, after the tensor
and sequence steps, so it wraps what this rank runs):

- built-in models (GPT, BERT, ViT), dp, ZeRO 1-3, offload, tp 1d / 2d / 2.5d / 3d and split_gather: each
  attention module's ``attend`` (the policy names it) becomes ``SelectiveCore`` around it, an instance
  attribute as sequence parallelism's is. The tensor modes change the Linears around the core, never the
  core, so nothing in it communicates and nothing is repeated but its own FLOPs.
- Hugging Face models (GPT-2, Llama, ...): ``config._attn_implementation`` becomes
  ``"colab_kit_selective:<the one it was>"``, a function registered in ``transformers``' attention registry
  that runs the one it was (sdpa, eager, colab_kit's dropout attention) under the same checkpoint.
- Ulysses (sp): the core between the two all-to-alls (``sequence.plan.SequencePlan.recompute_core``): the
  all-to-alls run once each way, as without recomputation.
- ring (sp): nothing more. ``sequence.ring.RingAttention`` is already the paper's selective recomputation:
  it keeps q, k, v, its output and log-sum-exp and its backward rebuilds every score block (and its dropout
  mask) as it goes round the ring again. Checkpointing it would repeat the forward's ``sp - 1`` K/V
  rotations in backward to drop its output and log-sum-exp; that is not done, so a ring step's collectives
  and activations under "selective" are those under "none" (``tests/ranks/test_selective.py`` counts them).
- pipelines (1f1b, interleaved, zb-h1, zb-v): the stages hold these same modules; the core runs again in
  B, or in the zero-bubble I (the core has no weight, so W has nothing of it to defer).
- precision: the core runs in the model's dtype both times. Dropout: the recomputation runs under the
  dropout coordinates of its first forward (``models.dropout.at`` through the checkpoint's ``context_fn``),
  so it draws the same masks.

What is kept, measured, the 4-block test GPT (d 32, 4 heads, t 16), 8 rows on one rank, fp32, bytes::

    none        1,133,700   (4 blocks of 266,240 B, the embeddings and the head)
    selective   1,125,508   (each block keeps 2,048 B less: its core's log-sum-exp, 4 N a, N = 128)
    full          134,276   (each block its input, 16,384 B)

equal to ``memory.activation_bytes(..., recompute=mode)["held"]`` to the byte (the test checks it).
A Hugging Face GPT-2 with attention dropout (eager attention) keeps far more in its core, and selective
falls between none and full there too (``tests/ranks/test_selective.py``).
"""
from __future__ import annotations

import sys
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError
from ..models import dropout
from ..policy import missing_policy_message, policy_for
from .hold import _Hold

__all__ = ["SelectiveCore", "recompute_attention", "is_selective", "hf_selective_attention"]

_PREFIX = "colab_kit_selective:"


class SelectiveCore:
    """``core(*args, **kwargs)`` run under ``torch.utils.checkpoint`` (non-reentrant): autograd keeps its
    tensor arguments (through ``_Hold``, where the activation meter sees them) and drops what the core
    saved inside; backward runs the core again under the dropout coordinates of its forward.

    >>> import torch.nn.functional as F
    >>> core = SelectiveCore(F.scaled_dot_product_attention)
    >>> q = torch.randn(1, 2, 4, 8, requires_grad=True)
    >>> torch.allclose(core(q, q, q, is_causal=True), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    True
    """

    def __init__(self, core):
        self.core = core

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation, generation: nothing is saved, nothing to recompute
            return self.core(*args, **kwargs)
        coords = dropout.current()
        held = tuple(_Hold.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
        return checkpoint(self.core, *held, use_reentrant=False,
                          context_fn=lambda: (nullcontext(), dropout.at(coords)), **kwargs)

    def __repr__(self) -> str:
        return f"SelectiveCore({self.core!r})"


def is_selective(fn) -> bool:
    """Whether ``fn`` (an attention's ``attend``) already recomputes in backward."""
    return isinstance(fn, SelectiveCore)


def hf_selective_attention(inner: str | None) -> str:
    """Register (once) and return the name of the ``transformers`` attention function that runs the one
    named ``inner`` (a config's ``_attn_implementation``: "sdpa", "eager", colab_kit's dropout attention)
    as a ``SelectiveCore``; its masks are made as ``inner``'s are."""
    inner = inner or "eager"
    if inner.startswith(_PREFIX):
        return inner
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _PREFIX + inner
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def attention(module, *args, **kwargs):
        if inner == "eager":  # the model's own, in its modelling file (not in the registry)
            core = sys.modules[type(module).__module__].eager_attention_forward
        else:
            core = ALL_ATTENTION_FUNCTIONS[inner]
        return SelectiveCore(core)(module, *args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def recompute_attention(model: nn.Module, policy=None, sequence=None) -> int:
    """Make every attention the policy names run its core again in backward (see the module docstring);
    returns how many attention modules changed (calling it twice changes nothing more). ``sequence``: this
    rank's ``SequencePlan`` (ring, Ulysses), which then recomputes its own core.

    >>> from colab_kit.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layers=2))
    >>> recompute_attention(model), is_selective(model.blocks[0].attn.attend), recompute_attention(model)
    (2, True, 0)
    """
    policy = policy_for(model, policy)
    what = "recompute='selective' (which recomputes each attention's core)"
    if policy is None:
        raise ConfigError(missing_policy_message(model, what))
    atts = policy.attentions(model)
    if not atts:
        raise ConfigError(f"{what} needs the attention modules: policy {policy.name!r} names none; name them "
                          f"(Policy(attention={{'<path>': Attention(attend='<method>')}})), or use recompute='full'")
    if sequence is not None:
        return sequence.recompute_core(SelectiveCore)
    changed, renamed = 0, set()  # a Hugging Face model's attentions share one config
    for path, module, a in atts:
        if a.hf:
            cfg = module.config
            name = hf_selective_attention(cfg._attn_implementation)
            if cfg._attn_implementation != name or id(cfg) in renamed:
                renamed.add(id(cfg))
                changed += 1
            cfg._attn_implementation = name
            continue
        if a.attend is None:
            raise ConfigError(f"{what} runs each attention's attend(q, k, v) under a checkpoint; policy "
                              f"{policy.name!r} names none for {path}: give Attention(attend='<method name>'), "
                              f"or use recompute='full'")
        attend = getattr(module, a.attend)
        if not is_selective(attend):
            setattr(module, a.attend, SelectiveCore(attend))
            changed += 1
    return changed

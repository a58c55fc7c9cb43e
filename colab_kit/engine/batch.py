"""What a training or evaluation batch must be before a step splits it (``check_batch``, from ``train_step``,
``evaluate`` and a pipeline's ``begin``).

Every rank holds the same global batch, so every rank refuses it alike, before any collective, with the rule
broken and what would work. What torch would refuse in one process is refused here too, under every config:
under tp the vocabulary-parallel embedding and loss mask the ids no rank owns, so an id past the vocabulary,
or nanoGPT's -1 for "ignore" (the built-in loss, as torch's ``cross_entropy``, ignores -100), would otherwise
train silently. Worked example, a GPT of vocabulary 64::

    engine.train_step((ids, targets))      # targets[0, 5] == -1
    ValueError: targets hold -1 (row 0, position 5): a target of the built-in loss is a class id in 0..63, or
    -100 where nothing is predicted (torch's ignore_index; nanoGPT's -1 is -100 here)

A loss of the user's own (``boost(..., loss_fn=)``) takes targets as it likes: only the rows are checked.
On a GPU the values are read once, at the first step (a device-to-host copy each step would stall it); a
batch on the CPU is checked at every step.
"""
from __future__ import annotations

import torch

from ..policy.hf import sliding_window

__all__ = ["check_batch", "label_sizes"]


def label_sizes(parts) -> tuple[int | None, int | None]:
    """``(token ids the model embeds, classes its loss predicts)`` of the dense model, None where unknown: the
    built-in configs' ``vocab_size`` / ``num_classes``, a Hugging Face model's ``config.vocab_size``."""
    cfg = parts.model_cfg
    if cfg is not None:
        vocab = getattr(cfg, "vocab_size", None)
        return vocab, getattr(cfg, "num_classes", vocab)
    hf = getattr(parts.dense_twin, "config", None)
    vocab = getattr(hf, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    return vocab, vocab


def _check_window(parts, inputs: torch.Tensor) -> None:
    """A model whose attention looks back a limited window (``policy.hf.sliding_window``) under sp or pp, which
    call the attention without the model's own mask: sequences up to the window only (the same attention)."""
    cfg = parts.config
    split = [f"{a}={getattr(cfg, a)}" for a in ("sp", "pp") if getattr(cfg, a) > 1]
    window = sliding_window(parts.dense_twin) if split and inputs.dim() >= 2 else None
    if window and inputs.shape[1] > window:
        raise ValueError(f"sequences of {inputs.shape[1]} tokens with {' and '.join(split)}: the model's attention "
                         f"looks back at most {window} tokens (a sliding window its own forward masks), and "
                         f"sequence and pipeline parallelism call the attention without that mask: use sequences of "
                         f"at most {window} tokens, or tp, dp and ZeRO, which run the model's own forward")


def _language_model(parts) -> bool:
    """Whether the model predicts one token per input token (a built-in GPT or BERT, or a policy whose loss is
    "tokens"): the built-in loss then takes targets of the inputs' shape. A model of the user's own without a
    policy may predict otherwise (the last position only, several tokens a position)."""
    cfg = parts.model_cfg
    if cfg is not None:
        return getattr(cfg, "vocab_size", None) is not None
    policy = parts.policy
    return policy is not None and policy.loss == "tokens" and bool(policy.sequence)


def _where(mask: torch.Tensor) -> str:
    at = [int(i) for i in mask.nonzero()[0]]
    return f"row {at[0]}" + (f", position {at[1]}" if len(at) > 1 else "")


def check_batch(batch, parts, values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of ``batch``, refused (ValueError) where it breaks a rule; ``values``: read the ids'
    and targets' values too (see the module docstring)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        got = f"a tensor of shape {tuple(batch.shape)}" if torch.is_tensor(batch) else type(batch).__name__
        raise ValueError(f"a batch is a pair (inputs, targets), got {got}: e.g. engine.train_step((ids, next_ids)) "
                         "for a language model")
    inputs, targets = batch
    if not (torch.is_tensor(inputs) and torch.is_tensor(targets)):
        raise ValueError(f"a batch is a pair of tensors (inputs, targets), got ({type(inputs).__name__}, "
                         f"{type(targets).__name__})")
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs and targets hold one row per example, got inputs {tuple(inputs.shape)} and "
                         f"targets {tuple(targets.shape)}: both [batch, ...] with the same batch")
    if parts.token_loss is None:  # the user's loss: its targets are its own business
        return inputs, targets
    vocab, classes = label_sizes(parts)
    tokens = not inputs.is_floating_point()
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"the built-in loss (cross-entropy) takes class ids as targets, got {targets.dtype}: "
                         "integer targets (torch.long), or boost(..., loss_fn=) for targets of another kind")
    if tokens and _language_model(parts) and inputs.dim() >= 2 and targets.dim() >= 2 and \
            targets.shape != inputs.shape:
        raise ValueError(f"targets {tuple(targets.shape)} for inputs {tuple(inputs.shape)}: a language model's "
                         "targets are one id per input token (the next ids), of the inputs' shape")
    _check_window(parts, inputs)
    if not values:
        return inputs, targets
    bad = (targets != -100) & ((targets < 0) | (targets >= classes if classes else False))
    if bad.any():
        top = f"{classes - 1}" if classes else "(the classes)"
        raise ValueError(f"targets hold {int(targets[bad][0])} ({_where(bad)}): a target of the built-in loss is a "
                         f"class id in 0..{top}, or -100 where nothing is predicted (torch's ignore_index; "
                         "nanoGPT's -1 is -100 here)")
    if tokens and vocab:
        out = (inputs < 0) | (inputs >= vocab)
        if out.any():
            raise ValueError(f"inputs hold id {int(inputs[out][0])} ({_where(out)}), outside the vocabulary "
                             f"0..{vocab - 1} of the model's token table")
    return inputs, targets

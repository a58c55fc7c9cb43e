"""What ``ck.boost`` itself costs one rank: its memory at the peak of start-up, before any step.

A model built dense costs every rank the whole model first (then its shards beside it while they are
cut). A model built on the meta device costs a rank only what it keeps, plus one dense tensor being cut
(``colab_kit.sharded_init``): under ZeRO-3 what it keeps is its dp piece of every chunk (parameters and
their gradient pieces; the optimizer's states come with the first step), made piece by piece
(``colab_kit.zero.chunks``), so no rank ever holds its whole tp/pp share, let alone the model.

Worked example, a GPT of 92.4M parameters (vocab 8192, d_model 1024, 6 layers, seq 32) under
``ParallelConfig(dp=4, zero=3)``, fp32::

    startup_bytes(cfg, config)              # meta: 88.1 MiB params + 88.1 MiB grads + 32 MiB (the token table)
    208.2 MiB                               # measured (VmHWM growth during boost, tests/ranks/test_zero3_meta.py): 210.3
    startup_bytes(cfg, config, meta=False)  # dense: the whole model (352 MiB) + the rank's 176 MiB
"""
from __future__ import annotations

from .estimator import stage_params
from .formulas import model_state_bytes

__all__ = ["startup_bytes", "largest_tensor"]


def largest_tensor(model) -> int:
    """Elements of a GPT-like model's largest dense tensor (token table, head, fc1/fc2, fused qkv, positions)."""
    d, ff = model.d_model, getattr(model, "d_ff", None) or 4 * model.d_model
    return max(model.vocab_size * d, ff * d, 3 * d * d, model.seq_len * d)


def startup_bytes(model, config, *, meta: bool = True, pp_rank: int | None = None) -> int:
    """Bytes one rank holds at the peak of ``boost`` of a GPT-like ``model`` (its config) under ``config``
    (fp32 build; the fullest pipeline rank unless ``pp_rank``): what it keeps (``model_state_bytes``' parameters,
    and with ZeRO its gradient pieces, made at boost) plus the largest dense tensor made whole to be cut
    (``meta``), or plus the whole model (built dense)."""
    per = stage_params(model, config)
    n = max(per) if pp_rank is None else per[pp_rank]
    states = model_state_bytes(n, "sgd", "fp32", config.dp, config.zero)
    kept = states["params"] + (states["grads"] if config.zero else 0)
    whole = sum(stage_params(model, type(config)()))  # the dense model, one rank
    return kept + 4 * (largest_tensor(model) if meta else whole)

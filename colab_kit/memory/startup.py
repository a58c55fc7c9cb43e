"""What ``ck.boost`` itself costs one rank: its memory at the peak of start-up, before any step.

A model built dense costs every rank the whole model first (then its shards beside it while they are
cut). A model built on the meta device costs a rank only what it keeps, plus one dense tensor being cut
(``colab_kit.sharded_init``): under ZeRO-3 what it keeps is its dp piece of every chunk (parameters and
their gradient pieces; the optimizer's states come with the first step), made piece by piece
(``colab_kit.zero.chunks``), so no rank ever holds its whole tp/pp share, let alone the model.

Worked example, a GPT of 92.4M parameters (vocab 8192, d_model 1024, 6 layers, seq 32) under
``ParallelConfig(dp=4, zero=3)``, fp32::

    startup_bytes(cfg, config)              # meta: 88.1 MiB params + 88.1 MiB grads + 32 MiB (the token table):
    208.2 MiB                               # measured 210.3 (VmHWM's growth in boost: tests/ranks/test_zero3_meta.py)
    startup_bytes(cfg, config, meta=False)  # dense: the whole model (352 MiB) + the rank's 176 MiB
"""
from __future__ import annotations

from .layout import part_params, stage_params
from .formulas import PRECISION_BYTES, model_state_bytes
from ..zero.chunks import padded

__all__ = ["startup_bytes", "largest_tensor", "gathered_bytes"]


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
    states = model_state_bytes(n, "sgd", "fp32", config.zero_ranks, config.zero)  # ZeRO over dp x sp
    kept = states["params"] + (states["grads"] if config.zero else 0)
    whole = sum(stage_params(model, type(config)()))  # the dense model, one rank
    return kept + 4 * (largest_tensor(model) if meta else whole)


def gathered_bytes(model, config, tied: bool = False) -> int:
    """The most bytes of whole ZeRO-3 chunks one rank holds at once inside a step (``ZeroStage3.peak_gathered``)
    of a GPT-like ``model`` under ``config``: its units (``colab_kit.zero.units``) are the embeddings, each block
    and the tail, each gathered around its use and prefetched one ahead, so the peak is the largest of

        embeddings + block 0 (forward's start, backward's end)   two blocks   the last block + the tail

    (the tail with the embeddings' chunk too when ``tied``); never the embeddings, the tail and a block together,
    which a 128k vocabulary would make 2 x 1B parameters at d 8192. Chunks are padded to a multiple of dp x sp.

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.models import GPTConfig
    >>> g = GPTConfig(vocab_size=32768, seq_len=32, d_model=128, n_heads=4, n_layers=2)
    >>> gathered_bytes(g, ParallelConfig(dp=4, zero=3))  # the embeddings (4.2M) + a block: not both vocab tables
    17586688
    """
    parts = part_params(model, config)
    width = PRECISION_BYTES[config.precision]
    embed, block, tail = (width * padded(parts[k], config.zero_ranks) for k in ("embed", "block", "tail"))
    tail = tail + embed if tied else tail
    return max(embed + block, 2 * block, block + tail)

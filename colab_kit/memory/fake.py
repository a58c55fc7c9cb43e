"""What a module saves for backward, counted on fake CPU tensors (``FakeTensorMode``: shapes and dtypes, no storage,
no compute, the CPU kernels' choices, e.g. SDPA's) by the meter's rule (``measure.ActivationMeter``: each storage
once, parameters never). ``estimator.traced_activations`` counts a dense model's forward this way, and
``moe_saves`` and ``saves.rms_kind`` one layer of it.

The engine's own meter counts, keyed by the storage object instead of its address (a fake storage has none):
each storage saved once, a freed one's identity taken again by a new storage counted again (keyed alone,
DeepSeek-V3's MoE layer was counted short, by a different amount in each trace).

    >>> import torch.nn as nn
    >>> saved_bytes(nn.Sequential(nn.Linear(8, 16), nn.GELU()), (3, 8), torch.float32)  # GELU's input, 3 x 16 x 4
    192
"""
from __future__ import annotations

import functools
import sys
import threading
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from ..measure import ActivationMeter
from ..policy.hf import without_kv_cache
from ..sharded_init import meta_twin

__all__ = ["saved_bytes", "per_token", "grouped_mm_shapes"]


def saved_bytes(module, shape: tuple, dtype, *, input_dtype=None, hidden: bool = True, output: bool = True) -> int:
    """Bytes ``module`` (a twin on the meta device is made: nothing of it is read but its shapes) saves for backward
    called on one input of ``shape``, every float parameter and buffer in ``dtype`` (as the engine casts them).
    ``hidden``: the input is a hidden state in ``dtype`` that needs its gradient, and its own bytes are the caller's
    (a block's count holds them); False: the model's input (``input_dtype``, int64 token ids by default; a float
    input in ``dtype``), counted where a layer keeps it. ``output`` False: the module's output is left out where
    the module keeps it itself (a ReLU's: the next layer's input, counted there). A Hugging Face model is traced
    as the engine runs it, without its KV cache (``policy.hf.without_kv_cache``)."""
    twin = meta_twin(module)
    twin.train()
    without_kv_cache(twin)  # the twin's own config (a deep copy)
    mode = FakeTensorMode()
    with mode:
        params = {n: torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype,
                                 requires_grad=p.requires_grad) for n, p in twin.named_parameters()}
        bufs = {n: torch.zeros(b.shape, dtype=dtype if b.is_floating_point() else b.dtype)
                for n, b in twin.named_buffers()}
        if hidden:
            x = torch.empty(shape, dtype=dtype, requires_grad=True)
        else:
            x = torch.zeros(shape, dtype=input_dtype or torch.int64)
            x = x.to(dtype) if x.is_floating_point() else x
    meter = ActivationMeter(exclude=[*params.values(), *([x] if hidden else [])], storage_id=_identity)
    with mode, grouped_mm_shapes()(), unpacked_rows(), meter.measure():
        out = functional_call(twin, {**params, **bufs}, (x,), strict=False)
    if not output and isinstance(out, torch.Tensor) and meter.holds(out):  # the caller's (a next layer saves it)
        return meter.last - out.untyped_storage().nbytes()
    return meter.last


def per_token(module, shape_of, dtype, **kw) -> tuple[int, int]:
    """``(bytes a token, bytes whatever the tokens)`` ``module`` saves, fitted on inputs of ``shape_of(2)`` and
    ``shape_of(4)`` (``saved_bytes``'s keywords): exact for what grows linearly with the tokens, as a layer's
    saved tensors do."""
    two, four = (saved_bytes(module, shape_of(n), dtype, **kw) for n in (2, 4))
    per = (four - two) // 2
    return per, two - 2 * per


_UNPACKED = threading.RLock()  # two threads tracing at once would otherwise leave the stand-in installed


@contextmanager
def unpacked_rows():
    """Hugging Face's mask builder asks, for a batch without a cache, whether its rows pack several sequences: it
    reads the position ids, which fake tensors do not hold, so a trace answered "maybe" and built a causal mask that
    SDPA then saved, as floats, in every layer (GPT-2: 2% of its activations). The engine's step calls the model on
    token ids alone (``engine.step``), so its forward makes positions 0..t-1 and every row is one sequence, what the
    real check finds; the trace is told so (``transformers.masking_utils.find_packed_sequence_indices`` answers None
    while it runs, one trace at a time). Nothing where transformers is not imported (its models import the module)."""
    masks = sys.modules.get("transformers.masking_utils")
    if getattr(masks, "find_packed_sequence_indices", None) is None:
        yield
        return
    with _UNPACKED:
        real = masks.find_packed_sequence_indices  # type: ignore[union-attr]
        masks.find_packed_sequence_indices = lambda *args, **kwargs: None  # type: ignore[union-attr]
        try:
            yield
        finally:
            masks.find_packed_sequence_indices = real  # type: ignore[union-attr]


def _identity(storage) -> int:
    return storage._cdata  # the storage object itself: a fake storage has no address


@functools.cache
def grouped_mm_shapes():
    """A dispatch mode's class that gives ``aten._grouped_mm`` of fp32 or fp16 inputs its output's shape under
    fake tensors. torch's meta kernel checks CUDA's rule (bf16 only), while the CPU kernel that really runs takes
    every float dtype: a Hugging Face MoE in fp32 (``grouped_mm`` experts) could not be traced. What autograd
    saves for the product (its two inputs) is saved above the dispatcher, and counted as before.

    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> offs = torch.tensor([2, 6], dtype=torch.int32)
    >>> with FakeTensorMode(), grouped_mm_shapes()():
    ...     out = torch._grouped_mm(torch.empty(6, 4), torch.empty(2, 4, 3), offs=offs)
    >>> tuple(out.shape), out.dtype
    ((6, 3), torch.float32)
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class GroupedMMShapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default:
                a, b = args[0], args[1]
                if a.dtype != torch.bfloat16 and a.dtype == b.dtype and b.dim() == 3:
                    if a.dim() == 2:  # tokens [S, K] by experts [E, K, N], grouped by offs: [S, N]
                        return a.new_empty((a.shape[0], b.shape[-1]))
                    if a.dim() == 3:  # a batch per expert: [E, S, K] by [E, K, N]
                        return a.new_empty((a.shape[0], a.shape[1], b.shape[-1]))
            return func(*args, **(kwargs or {}))

    return GroupedMMShapes

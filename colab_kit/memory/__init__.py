"""Measured memory per rank, by category, with the analytic estimate beside it.

Measured, on this rank, in bytes (each storage counted once):

- ``params``: the model's parameters held here;
- ``grads``: gradient storage (the data-parallel buckets);
- ``optimizer``: every tensor in the optimizer's state (Adam's two moments, SGD's momentum);
- ``activations``: tensors autograd saved for backward during the last forward,
  the peak over the step's microbatches (parameters saved by a layer are not counted
  twice). ``ActivationMeter`` records them with ``torch.autograd.graph.saved_tensors_hooks``.

Worked example, the demo GPT (110,336 fp32 parameters in 37 tensors) with AdamW,
dp=4 and a global batch of 32 rows: every rank reports params 441,344 B, grads
441,344 B, optimizer 882,836 B (two moments, 882,688 B, and a 4-byte step counter
per tensor) and activations 2,328,836 B for its 8 rows.

Estimated, the same categories (``estimate``): the model states from the ZeRO paper's
formulas (``model_state_bytes``: 16 bytes per parameter with fp32 Adam, divided over dp
stage by stage), the activations from a count of what each GPT op saves
(``activation_bytes``). For the example above ``estimate(110_336, "adamw", model=cfg,
rows=8)`` gives params 441,344, grads 441,344, optimizer 882,688 (no step counters) and
activations 2,316,548 B: the meter counts 12,288 B more, the whole batch's token ids and
targets that the rank's rows are slices of. With ``recompute=True`` (``colab_kit.recompute``)
each block keeps only its input: 334,084 B estimated (the meter: the same 12,288 B more).

Where each part lives:

    (colab_kit/measure.py, below the parallel parts that count their buffers with it: what this rank
    holds, measured: tensor_bytes, optimizer_bytes, ActivationMeter; re-exported here)
    formulas.py    the analytic model: ZeRO's model-state formulas, the activations each op saves
    estimator.py   one rank's estimate under any ParallelConfig (what engine.memory_estimate() reports)
    shape.py       ModelShape: a decoder's widths, counts and FLOPs (what ck.estimate prices)
    moe_shape.py   a mixture of experts' ModelShape (the MoE GPT's, or read off a Hugging Face model) and its walk
    startup.py     what boost itself costs a rank at its peak (a meta model: its shards and one dense tensor)
    peak.py        the in-step peak of model-state bytes, measured from outside on any code
    timeline.py    ck.memory_timeline(engine): bytes held after every op of one step
    history.py     the same timeline on a GPU from CUDA's allocator log
"""
from __future__ import annotations

from .estimator import config_estimate, rank_params
from .startup import startup_bytes
from .formulas import (OPTIMIZER_STATES, PRECISION_BYTES, activation_bytes, estimate, model_state_bytes,
                       optimizer_states, placed)
from ..measure import ActivationMeter, SavedRef, optimizer_bytes, tensor_bytes

__all__ = ["tensor_bytes", "optimizer_bytes", "ActivationMeter", "estimate", "model_state_bytes", "activation_bytes",
           "optimizer_states", "placed", "PRECISION_BYTES", "OPTIMIZER_STATES", "config_estimate", "rank_params",
           "SavedRef", "startup_bytes"]

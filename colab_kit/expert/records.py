"""What the engine records of its mixture-of-experts layers at each step: ``engine.records[i]["moe"]``.

Each MoE layer's first forward of each microbatch writes what it routed into the microbatch's ``MoEStep``
(``colab_kit.models.moe_context``: ``seen``). At the end of the step the engine sums them over microbatches
and averages the losses, and the step's loss all-reduce carries the layers' balancing and z losses beside the
loss (one vector instead of one number: no collective of its own), so every rank records the whole batch's
values. Per layer on this rank (with pp, the layers of its stages), in the record of the step::

    {"layer": 1,                   # the MoE layer's number in the model (0, 1, ...)
     "counts": [40, 22, 31, 35],   # assignments per expert over the whole batch (every rank, every microbatch)
     "mine": [11, 4, 9, 8],        # this rank's tokens' assignments
     "dropped": 3,                 # assignments a capacity dropped, whole batch
     "balance": 1.04,              # the Switch balancing loss E sum_i f_i P_i (1.0: uniform), before its
     "z": 4.21,                    #   coefficient, and the router z-loss, whole batch, mean over microbatches
     "sent": [512, 1536],          # with ep: bytes of rows this rank sent to each ep rank (dispatch, forward)
     "received": [768, 1280]}      #   and received from each

The layers keep what they routed as detached tensors; ``step_layers`` reads them all at the step's end, in
one transfer (``on_host``): one device->host sync per step for the records, not one per layer and microbatch
in the middle of the forward; the loss vector is built on the device (``loss_vector``). The host reads a
layer's forward still makes are the ones its compute needs: the built-in MoE's token count (an ``int``: a
capacity's size and the losses' scale), with a capacity ``dispatch``'s ``nonzero`` and ``MoE.last["dropped"]``,
``torch._grouped_mm``'s and ``GroupBias``'s ``segment_reduce``'s own, expert parallelism's split sizes
(``all_to_all_v`` takes host ints: ``sent`` / ``received`` come from them, host ints at no cost), and whatever
HF's own MoE block reads; counts are summed by ``index_add_`` (a CUDA ``bincount`` reads its size on the host).
On one H200 a training step of the test MoE GPT makes 27 host syncs and of the test Mixtral 18 (43 and 28
before these changes; ``python bench/gpu_moe_check.py syncs`` lists them by line).

``traffic(records, layout)`` (in the kernel, from every rank's record of a step) makes the rank x rank matrix of
dispatch bytes; tests check the counts against one process's routing, the
losses against one process's, and the matrix against the comm records.
"""
from __future__ import annotations

import torch
from ..config import Axis

__all__ = ["step_layers", "on_host", "loss_vector", "with_losses", "traffic"]

SUMMED = ("counts", "mine", "sent", "received")
INTS = ("counts", "mine", "dropped", "sent", "received")
"""The records' integer fields; ``balance`` and ``z`` are floats."""


def on_host(steps) -> list[dict[int, dict]]:
    """Each ``MoEStep``'s ``seen`` with its tensors as Python numbers (lists for vectors), read in one transfer:
    every tensor of every layer and microbatch flattened into one float64 vector, one ``.tolist()`` (float64
    holds the counts exactly up to 2^53, and a float32 or bf16 loss exactly, as ``float()`` of it would).

        >>> from colab_kit.models.moe_context import MoEStep
        >>> s = MoEStep(seen={0: {"counts": torch.tensor([3, 1]), "dropped": 0, "z": torch.tensor(0.5)}})
        >>> on_host([s])
        [{0: {'counts': [3, 1], 'dropped': 0, 'z': 0.5}}]
    """
    tensors = [v for step in steps for seen in step.seen.values() for v in seen.values() if isinstance(v, torch.Tensor)]
    flat: list[float] = []
    if tensors:
        device = tensors[0].device
        flat = torch.cat([t.detach().reshape(-1).to(device, torch.float64) for t in tensors]).tolist()
    out, at = [], 0
    for step in steps:
        layers = {}
        for layer, seen in step.seen.items():
            rec = {}
            for key, v in seen.items():
                if isinstance(v, torch.Tensor):
                    n, at = v.numel(), at + v.numel()
                    got = [int(x) for x in flat[at - n:at]] if key in INTS else flat[at - n:at]
                    v = got if v.dim() else got[0]
                rec[key] = v
            layers[layer] = rec
        out.append(layers)
    return out


def step_layers(steps) -> dict[int, dict]:
    """Per MoE layer number, its records over the step's microbatches (``MoEStep``s): counts, drops and bytes
    summed; the rank's loss shares, times each step's ``pieces``, averaged. The layers' tensors are read on the
    host here, all at once (``on_host``): the step's one host read for the records."""
    steps = list(steps)
    out: dict[int, dict] = {}
    m = max(len(steps), 1)
    for step, host in zip(steps, on_host(steps)):
        for layer, seen in host.items():
            rec = out.setdefault(layer, {"layer": layer, "dropped": 0, "balance": 0.0, "z": 0.0})
            for key in SUMMED:
                if key in seen:
                    rec[key] = [a + b for a, b in zip(rec.get(key, [0] * len(seen[key])), seen[key])]
            rec["dropped"] += seen["dropped"]
            rec["balance"] += seen["balance"] * step.pieces / m
            rec["z"] += seen["z"] * step.pieces / m
    return out


def loss_vector(local: torch.Tensor, steps, n_layers: int) -> torch.Tensor:
    """``[loss, balance of MoE layer 0 .. n-1, z of layer 0 .. n-1]``: this rank's shares (each microbatch's
    ``MoEStep`` value times its ``pieces``, averaged over the microbatches; zero for a layer on another pipeline
    stage), to be summed over pp and averaged over dp, sp and tp as the loss is. Built on the device from the
    layers' tensors: no value goes to the host and back (``bench/gpu_moe_check.py syncs`` counts it).

        >>> from colab_kit.models.moe_context import MoEStep
        >>> s = MoEStep(pieces=2, seen={1: {"balance": torch.tensor(0.5), "z": torch.tensor(2.0)}})
        >>> loss_vector(torch.tensor(3.0), [s], n_layers=2).tolist()
        [3.0, 0.0, 1.0, 0.0, 4.0]
    """
    steps = list(steps)
    m = max(len(steps), 1)
    out = torch.zeros(1 + 2 * n_layers, dtype=local.dtype, device=local.device)
    out[0] = local.reshape(())
    for step in steps:
        for layer, seen in step.seen.items():
            for at, key in ((1 + layer, "balance"), (1 + n_layers + layer, "z")):
                v = seen[key]
                out[at] += (v.to(out.device, out.dtype) if isinstance(v, torch.Tensor) else v) * (step.pieces / m)
    return out


def with_losses(layers: dict[int, dict], reduced: list[float], n_layers: int) -> list[dict]:
    """The records of this rank's layers with the whole batch's losses read from the reduced vector."""
    out = []
    for layer in sorted(layers):
        rec = dict(layers[layer])
        rec["balance"], rec["z"] = reduced[1 + layer], reduced[1 + n_layers + layer]
        out.append(rec)
    return out


def traffic(records: dict[int, list[dict]], layout, layer: int | None = None) -> list[list[int]]:
    """The ``world x world`` matrix of dispatch bytes of one step: ``[i][j]`` = bytes rank i sent to rank j in
    the forward dispatch of ``layer`` (None: every layer). ``records[rank]``: that rank's ``"moe"`` list of the
    step; ``layout``: the run's ``MeshLayout`` (its ep groups say who rank i's ep rank k is)."""
    world = layout.world_size
    out = [[0] * world for _ in range(world)]
    for rank, layers in records.items():
        group = layout.group_of(rank, Axis.EP) if Axis.EP in layout.axes else [rank]
        for rec in layers:
            if layer is not None and rec["layer"] != layer:
                continue
            for k, nbytes in enumerate(rec.get("sent", [])):
                out[rank][group[k]] += nbytes
    return out

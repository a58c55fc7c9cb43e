"""Look inside a sharded model on a live mesh: who holds which block, what one layer sends.

Both are measured on the real layers, not drawn from a plan:

- ``owner_map(layer)`` fills each rank's shard of ``layer.weight`` with that rank's
  number and gathers it back with the layer's own ``to_dense()``: the result is the
  dense ``[out, in]`` weight with every entry replaced by the rank that holds it
  (for blocks replicated over ``dp`` or 2.5D's depth, the copy ``to_dense`` reads).
- ``LayerTraffic(module, mesh)`` counts the bytes this rank hands to collectives
  while ``module`` runs its forward and its backward (the payload, the papers' unit),
  and beside them the bytes it sends on the wire (``colab_kit.comm`` states both models).

On 2 ranks with 1D tensor parallelism, ``owner_map`` of an MLP's ``fc1`` (4 -> 8) is::

    [[0, 0, 0, 0],      rows 0..3 (output features 0..3) on rank 0
     ...
     [1, 1, 1, 1]]      rows 4..7 on rank 1
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["owner_map", "LayerTraffic", "dense_state"]


@torch.no_grad()
def owner_map(layer: nn.Module) -> torch.Tensor:
    """``[out, in]`` integer tensor: the global rank holding each weight entry (collective)."""
    weight, to_dense = layer.weight, layer.to_dense
    assert isinstance(weight, torch.Tensor) and callable(to_dense)  # a tensor-parallel linear
    saved = weight.detach().clone()
    weight.fill_(dist.get_rank())
    try:
        dense = to_dense()
    finally:
        weight.copy_(saved)
    return dense.weight.detach().round().to(torch.int64)


@torch.no_grad()
def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's parameters by their dense names, gathered from every rank (a collective:
    every rank of the tensor group calls it). Sharded layers gather through their ``to_dense``;
    parameters outside them (1D's LayerNorms and position table) are whole on every rank already.

    After ``Plan1D(mesh).parallelize(GPT(cfg))`` on 2 ranks, ``dense_state(model)["blocks.0.attn.qkv.weight"]``
    is the ``[3d, d]`` weight again, on both ranks, as ``GPT(cfg)`` would hold it.
    """
    sharded = [(name, mod) for name, mod in model.named_modules() if name and hasattr(mod, "to_dense")]
    out = {}
    for name, mod in sharded:
        for pname, p in mod.to_dense().named_parameters():
            out[f"{name}.{pname}"] = p.detach().clone()
    inside = tuple(name + "." for name, _ in sharded)
    for pname, p in model.named_parameters():
        if not pname.startswith(inside):
            out[pname] = p.detach().clone()
    return out


class LayerTraffic:
    """Bytes of collectives run inside ``module``'s forward and backward on this rank.

    Inside a rank (``engine`` boosted with tensor parallelism)::

        traffic = LayerTraffic(engine.module.blocks[0].mlp.fc1, engine.mesh)   # before the step
        engine.train_step(batch)
        traffic.forward, traffic.backward     # payload bytes, by direction
        traffic.wire                          # {"forward": ..., "backward": ...}: bytes sent
    """

    def __init__(self, module: nn.Module, mesh):
        self.mesh, self.forward, self.backward = mesh, 0, 0
        self.wire = {"forward": 0, "backward": 0}
        self.by_axis: dict[str, int] = {}
        self._mark = 0
        self._hooks = [module.register_forward_pre_hook(lambda *a: self._start()),
                       module.register_forward_hook(lambda *a: self._stop("forward")),
                       module.register_full_backward_pre_hook(lambda *a: self._start()),
                       module.register_full_backward_hook(lambda *a: self._stop("backward"))]

    def _start(self) -> None:
        self._mark = len(self.mesh.log.records)

    def _stop(self, direction: str) -> None:
        records = self.mesh.log.records[self._mark:]
        setattr(self, direction, getattr(self, direction) + sum(r.bytes for r in records))
        self.wire[direction] += sum(r.wire for r in records)
        for r in records:
            self.by_axis[r.axis] = self.by_axis.get(r.axis, 0) + r.bytes

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

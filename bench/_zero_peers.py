"""The PyTorch-native peers of ``bench/zero.py``, and how each side's bytes are counted.

Each peer trains ``GPT(gcfg)`` (the same seed as colab_kit's copy) on this rank's rows of the
global batch and returns the global mean loss, as ``engine.train_step`` does:

- ``fsdp2``: ``fully_shard`` on every block, then on the root (FSDP2's usual wrapping), with
  ``reshard_after_forward`` (True: ZeRO-3; False: ZeRO-2), optionally ``CPUOffloadPolicy``
  (``pin_memory=False``: pinning needs a GPU) or ``MixedPrecisionPolicy(bf16, reduce fp32)``;
  AdamW over its sharded DTensor parameters.
- ``zero_redundancy``: ``DistributedDataParallel`` (``gradient_as_bucket_view=True``, so that the
  gradients are the reducer's buckets and nothing is held twice) with
  ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamW)``: ZeRO-1.

Every side keeps its gradients allocated between steps (``zero_grad(set_to_none=False)``), as
colab_kit keeps its gradient buffers or pieces, so "held after a step" means the same thing on
both sides. ``memory()`` counts this rank's local pieces: a DTensor's ``to_local()``, a plain
tensor as it is; the optimizer's state tensors (ZeroRedundancyOptimizer: its local optimizer,
which holds the states of this rank's parameters only).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from colab_kit.engine.core import lm_loss
from colab_kit.models import GPT

__all__ = ["local_bytes", "model_state", "fsdp2", "zero_redundancy", "PEERS"]

ADAMW_LR = 1e-3


def adamw(params, foreach: bool | None = True):
    """AdamW as both sides run it: ``foreach=True`` (one fused call per op over every tensor it steps); None is
    torch's default, which on CPU steps each tensor in turn (FSDP2's ~50 DTensors against colab_kit's few flat
    pieces: a per-tensor loop would charge the peer for dispatch, not for sharding)."""
    return torch.optim.AdamW(params, lr=ADAMW_LR, foreach=foreach)


def local_bytes(tensors) -> int:
    """Bytes of this rank's local pieces (a DTensor's ``to_local()``, a plain tensor as it is)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def model_state(params, optimizer) -> dict:
    """{"params", "grads", "optimizer"} bytes this rank holds now."""
    params = list(params)
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
            "optimizer": local_bytes(v for st in optimizer.state.values() for v in st.values())}


class Peer:
    """One rank's side of a PyTorch-native run: ``step(x, y) -> global mean loss``, ``memory()``."""

    def __init__(self, model, optimizer, state_of, loss_fn=lm_loss):
        self.model, self.optimizer, self.state_of, self.loss_fn = model, optimizer, state_of, loss_fn
        self.world = dist.get_world_size()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        loss = loss.detach()
        dist.all_reduce(loss)
        return loss.item() / self.world

    def memory(self) -> dict:
        return self.state_of()


def _lm_loss_fp32(logits, targets):
    """The loss on fp32 logits, as colab_kit's mixed precision takes it (``loss_in_fp32``)."""
    return lm_loss(logits.float(), targets)


def fsdp2(gcfg, *, reshard: bool, offload: bool = False, bf16: bool = False, foreach: bool | None = True) -> Peer:
    """FSDP2 over all ranks: per block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = GPT(gcfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = {"mesh": mesh, "reshard_after_forward": reshard}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = adamw(model.parameters(), foreach)
    return Peer(model, opt, lambda: model_state(model.parameters(), opt), _lm_loss_fp32 if bf16 else lm_loss)


def zero_redundancy(gcfg, foreach: bool | None = True) -> Peer:
    """DDP + ZeroRedundancyOptimizer (AdamW): the optimizer states of whole parameters split over ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(GPT(gcfg), gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=ADAMW_LR, foreach=foreach)
    return Peer(model, opt, lambda: model_state(model.parameters(), opt.optim))


# name -> (colab_kit ParallelConfig fields, peer label, peer builder (gcfg, foreach), loss threshold key)
PEERS = {
    "zero3": ({"zero": 3}, "FSDP2 fully_shard (reshard_after_forward=True)",
              lambda g, f=True: fsdp2(g, reshard=True, foreach=f), "fp32"),
    "zero2": ({"zero": 2}, "FSDP2 fully_shard(reshard_after_forward=False)",
              lambda g, f=True: fsdp2(g, reshard=False, foreach=f), "fp32"),
    "zero1": ({"zero": 1}, "DDP + ZeroRedundancyOptimizer",
              lambda g, f=True: zero_redundancy(g, foreach=f), "fp32"),
    "zero3-offload": ({"zero": 3, "offload": "cpu"}, "FSDP2 + CPUOffloadPolicy(pin_memory=False)",
                      lambda g, f=True: fsdp2(g, reshard=True, offload=True, foreach=f), "fp32"),
    "bf16-zero2": ({"zero": 2, "precision": "bf16"}, "FSDP2 (reshard_after_forward=False) + "
                   "MixedPrecisionPolicy(bf16, reduce fp32)",
                   lambda g, f=True: fsdp2(g, reshard=False, bf16=True, foreach=f), "bf16"),
    "bf16-zero3": ({"zero": 3, "precision": "bf16"}, "FSDP2 (reshard_after_forward=True) + "
                   "MixedPrecisionPolicy(bf16, reduce fp32)",
                   lambda g, f=True: fsdp2(g, reshard=True, bf16=True, foreach=f), "bf16"),
}

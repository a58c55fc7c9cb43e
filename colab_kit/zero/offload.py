"""Heterogeneous memory: ZeRO's model states on the device or the host (ZeRO-Offload, Gemini).

Two parts, one account:

- ``offload="cpu"`` with zero=1 or 2 (Ren et al. 2021, ZeRO-Offload) is ``ZeroStage1`` with
  its fp32 masters (``colab_kit.precision.MasterWeights``) on the host, in fp32 as in mixed
  precision: the parameters stay on the device, whole, for compute; the optimizer steps the
  host copies of this rank's pieces, with its states there. Per step: the reduced gradient
  pieces go to the host, the host steps, the updated pieces come back and are all-gathered.
- ``ChunkPlacement`` (zero=3, ``offload="cpu"`` or ``"auto"``; Colossal-AI's Gemini): every
  chunk's model states (its shard, the shard's gradient and its optimizer states) live on the
  device or on the host, as one. ``"cpu"`` puts every chunk on the host. ``"auto"`` keeps on
  the device as many chunks as ``device_budget`` leaves room for, once the first step
  (run with every chunk on the host) has measured what a step needs on the device besides
  the chunks' states: the gathered parameters, gradient buffers and activations.
  Which chunks stay is Belady's rule at the step boundary: when the budget is short, the
  chunk evicted is the one the next step needs furthest ahead. A step uses the chunks in
  forward order (the rest of the model, block 0, block 1, ...), so the last blocks go to the
  host first. Within a step chunks do not move: moving a chunk costs its states (16 bytes a
  parameter with Adam, per rank) each way, while a chunk on the host costs a staged copy of
  its shard (4 bytes) for each gather and its gradient piece back.

A chunk on the host is gathered through a staged copy of its shard on the device, its
reduce-scatter lands on the device and is added into the host gradient, and its update runs
on the host. On a machine with a GPU the tensors really move, the copies on side streams
(``colab_kit.zero.copies``: a shard copied one unit ahead of its gather); on one without,
the device is an account kept over the same host memory: each decision is made, recorded
(``ChunkPlacement.log``) and enforced (``Account.check`` raises ``DeviceBudgetExceeded``
when the device side would pass the budget) exactly as it would be with a GPU.

Worked example, dp=2, a GPT of 2 blocks, chunks R (rest) 8 KiB, b0 and b1 24 KiB whole, so
per rank (fp32 Adam, 16 bytes a parameter over 2 ranks) states of R 16 KiB, b0 and b1 48 KiB;
a step measured at 100 KiB of gathered chunks, gradient buffers and activations;
``device_budget`` = 180 KiB::

    step 1   R, b0, b1 on the host (the safe start); the account records 100 KiB at most
    after    room = 180 - 100 = 80 KiB: R (16) fits, b0 (48) fits, b1 (48) does not
             -> R, b0 on the device; b1 stays on the host (needed furthest ahead)
    step 2+  device at most 100 + 64 = 164 KiB <= 180; b1 staged for its gathers, stepped on the host
"""
from __future__ import annotations

import torch

from ..measure import tensor_bytes
from ..config import ConfigError
from ..precision import pinned_copy
from .copies import Copies, Copy

__all__ = ["Account", "DeviceBudgetExceeded", "ChunkPlacement", "host_device"]


def host_device() -> torch.device:
    return torch.device("cpu")


class DeviceBudgetExceeded(MemoryError):
    """The device side of the account would pass ``device_budget``."""


class Account:
    """Bytes held on the device now, by what holds them, against ``budget`` (None: no limit)."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.held: dict[str, int] = {}
        self.peak = 0
        self.step_peak = 0

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def set(self, what: str, nbytes: int) -> None:
        """Hold ``nbytes`` under ``what`` (replacing what it held); raises when over the budget."""
        old = self.held.get(what, 0)
        self.held[what] = nbytes
        total = self.total
        if self.budget is not None and total > self.budget:
            self.held[what] = old
            raise DeviceBudgetExceeded(
                f"device_budget={self.budget:,} B would be exceeded by {what} ({nbytes:,} B): the device would "
                f"hold {total:,} B ({self._top()}); raise device_budget to at least {total:,} B, or use "
                f"offload='cpu'")
        self.peak = max(self.peak, total)
        self.step_peak = max(self.step_peak, total)

    def drop(self, what: str) -> None:
        self.held.pop(what, None)

    def _top(self) -> str:
        top = sorted(self.held.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{k} {v:,} B" for k, v in top)


def _move(t: torch.Tensor, device: torch.device) -> None:
    """Move ``t``'s data to ``device``; to the host from a GPU into pinned memory, so that the copies of its
    shard back to the GPU at each gather (``staged``) run without the host waiting."""
    if t is not None and t.device != device:
        if device.type == "cpu" and t.device.type == "cuda":
            t.data = pinned_copy(t.data)
        else:
            t.data = t.data.to(device)


class ChunkPlacement:
    """Where each ZeRO-3 chunk's states live; ``"cpu"``: all on the host, ``"auto"``: under a budget."""

    def __init__(self, chunks, mode: str, device: torch.device, budget: int | None = None, units=None,
                 outer=None):
        self.chunks, self.mode, self.device, self.budget = chunks, mode, torch.device(device), budget
        self.units: list[list[int]] = units if units is not None else [[c.index] for c in chunks]
        """Per block, its chunks' indices: with ep a block's dense chunk and its expert chunk, gathered
        together (``colab_kit.zero.split.chunk_units``)."""
        self.outer: list[list[int]] = outer if outer is not None else []
        """Per unit outside the blocks (embeddings, tail: ``colab_kit.zero.units``), the chunks it gathers."""
        self.account = Account(budget)
        self.where = ["device"] * len(chunks)
        self.log: list[dict] = []
        self.optimizer = None
        self.keys: list | None = None  # per chunk, the tensor the optimizer steps (set by ZeroStage3)
        self.state_keys = None  # per chunk, the tensors whose optimizer states go with it (views per param group)
        self.step = 0
        self.transfers = {"to_device": 0, "to_host": 0}
        """Bytes copied between host and device in the step running now: staged shards (each gather of a chunk
        on the host), reduced gradient pieces back to the host, states moved by ``place``."""
        self.last_transfers = dict(self.transfers)
        """The same for the last step finished (``after_step``)."""
        self.copies = Copies(self.device)
        """The host <-> device copies (``colab_kit.zero.copies``): on a GPU, on a side stream."""
        self.ahead: dict[int, Copy] = {}
        """Shards of host chunks copied to the device one unit ahead of their all-gather (``stage_ahead``)."""
        if mode in ("cpu", "auto"):  # "auto" starts on the host and measures its first step
            for c in chunks:
                self.place(c.index, "host", "offload='cpu'" if mode == "cpu" else "first step measured on the host")

    # ------------------------------------------------------------------ states of a chunk
    def state_tensors(self, i: int) -> list[torch.Tensor]:
        """Chunk ``i``'s shard and its gradient, then what the optimizer steps for it (the shard, or
        its fp32 master under mixed precision) and that tensor's optimizer states."""
        c = self.chunks[i]
        out = [c.shard, c.shard.grad]
        key = self.keys[i] if self.keys is not None else c.shard
        if key is not c.shard:
            out.append(key)
        if self.optimizer is not None:
            for k in (self.state_keys[i] if self.state_keys is not None else [key]):
                out += [v for v in self.optimizer.state.get(k, {}).values() if isinstance(v, torch.Tensor)]
        return out

    def state_bytes(self, i: int) -> int:
        return tensor_bytes(self.state_tensors(i))

    def place(self, i: int, where: str, reason: str) -> None:
        """Put chunk ``i``'s states on ``where`` ('device' or 'host'), recorded with ``reason``."""
        target = self.device if where == "device" else host_device()
        if where != self.where[i]:
            self.transfers["to_device" if where == "device" else "to_host"] += self.state_bytes(i)
        for t in self.state_tensors(i):
            _move(t, target)
        self.log.append({"step": self.step, "chunk": self.chunks[i].name, "to": where, "moved": where != self.where[i],
                         "bytes": self.state_bytes(i), "reason": reason})
        self.where[i] = where
        self._account_states()

    def _account_states(self) -> None:
        on_device = sum(self.state_bytes(i) for i, w in enumerate(self.where) if w == "device")
        self.account.held["chunk states"] = on_device  # placement itself is checked by plan(), not here

    # ------------------------------------------------------------------ during a step
    def staged(self, i: int) -> torch.Tensor:
        """Chunk ``i``'s shard on the device, for its all-gather (a copy when it lives on the host: the one
        ``stage_ahead`` started, or one started now); the compute stream waits for it, the host does not."""
        c = self.chunks[i]
        if self.where[i] != "host":
            return c.shard.detach()
        copy = self.ahead.pop(i, None)
        if copy is not None:
            self.account.drop(f"shard ahead {c.name}")
        else:
            copy = self._copy(i)
        self.account.set(f"staged shard {c.name}", c.shard.numel() * c.shard.element_size())
        return copy.wait()

    def stage_ahead(self, i: int) -> None:
        """Start copying chunk ``i``'s shard to the device now, a unit before its all-gather, so that the
        copy runs beside the compute in between (on a GPU: on the side stream)."""
        c = self.chunks[i]
        if self.where[i] == "host" and i not in self.ahead and c.state == "free":
            self.account.set(f"shard ahead {c.name}", c.shard.numel() * c.shard.element_size())
            self.ahead[i] = self._copy(i)

    def _copy(self, i: int) -> Copy:
        shard = self.chunks[i].shard
        self.transfers["to_device"] += shard.numel() * shard.element_size()
        return self.copies.to_device(shard.detach())  # pinned (``_move``)

    def unstage(self, i: int) -> None:
        self.account.drop(f"staged shard {self.chunks[i].name}")

    def drain(self) -> None:
        """Before the optimizer steps (or the model is read): every copy landed, none ahead kept (the
        shards are about to change)."""
        for i in self.ahead:
            self.account.drop(f"shard ahead {self.chunks[i].name}")
        self.ahead = {}
        self.copies.drain()

    def hold(self, what: str, nbytes: int) -> None:
        self.account.set(what, nbytes)

    def release(self, what: str) -> None:
        self.account.drop(what)

    # ------------------------------------------------------------------ between steps
    def host_bytes(self, optimizer) -> dict:
        out = {"params": 0, "grads": 0, "optimizer": 0}
        for i, w in enumerate(self.where):
            if w == "host":
                c = self.chunks[i]
                out["params"] += c.shard.numel() * c.shard.element_size()
                out["grads"] += c.shard.grad.numel() * c.shard.grad.element_size()
                out["optimizer"] += tensor_bytes(self.state_tensors(i)[2:])  # (master and) states
        return out

    def check_step(self, chunks, activations: int) -> None:
        """Refuse, before a step runs, a budget below what one step holds on the device at once
        whatever the placement: the embeddings or the tail whole with its gradient buffer, two blocks
        whole (one in use, one prefetched), a block's gradient buffer, a unit's staged shards and the next's copied
        ahead, and the activations held for this step."""
        whole = [sum(chunks[i].nbytes for i in unit) for unit in self.units]  # a unit's chunks, gathered together
        rest = max([sum(chunks[i].nbytes for i in unit) for unit in self.outer] or [0])
        big = max(whole or [0])
        piece = max(sum(chunks[i].shard.numel() * chunks[i].shard.element_size() for i in unit)
                    for unit in self.units + self.outer)  # a unit's shards, staged together
        acts = activations
        need = 2 * rest + 3 * big + 2 * piece + acts
        if need > self.budget:
            raise ConfigError(
                f"device_budget={self.budget:,} B is too small for one step of this model: the device holds at once "
                f"the embeddings or the tail and its gradient (2 x {rest:,} B), two blocks and a block's gradient "
                f"(3 x {big:,} B), a unit's shards staged and the next's copied ahead (2 x {piece:,} B) and the "
                f"activations ({acts:,} B): at least {need:,} B. Raise device_budget, use a smaller batch or "
                f"recompute=True, or more dp ranks")

    def after_step(self, next_activations: int | None = None) -> None:
        """After each step: with "auto", after the first step, place the chunks (``plan``). ``next_activations``:
        what the next step will reserve for activations (the larger of this step's measurement and the
        estimate); where that is more than this step held (an estimate below what the routing of a mixture of
        experts made, say), the plan leaves the difference free too.

        First step reserved 376,964 B (the estimate), measured 398,732 B: the plan keeps 21,768 B more room."""
        self.step += 1
        measured = self.account.step_peak
        self.account.step_peak = 0
        if self.mode == "auto" and self.step == 1:
            grow = max(0, (next_activations or 0) - self.account.held.get("activations", 0))
            self.plan(measured + grow)
        self.last_transfers, self.transfers = self.transfers, {"to_device": 0, "to_host": 0}

    def plan(self, measured: int) -> None:
        """Belady at the step boundary: keep chunks on the device in the order the next step uses
        them (forward order) while the budget leaves room beside ``measured`` (the first step's
        device peak with every chunk on the host); the rest stay on the host."""
        assert self.budget is not None  # boost refuses offload="auto" without a device_budget
        room = self.budget - measured
        for i in range(len(self.chunks)):
            need = self.state_bytes(i)
            if need <= room:
                room -= need
                self.place(i, "device", f"fits: {need:,} B of states, {room:,} B of the budget left")
            else:
                self.place(i, "host", f"{need:,} B of states do not fit in the {room:,} B left: needed furthest "
                                      f"ahead of what is kept")

"""What this rank holds, measured: bytes of tensors (each storage once), of an optimizer's state, and of
the tensors autograd saved for backward (``ActivationMeter``). The categories and a worked example are in
``colab_kit.memory``'s docstring."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["tensor_bytes", "optimizer_bytes", "ActivationMeter", "SavedRef"]




def _address(storage) -> int:
    return storage.data_ptr()


def _storage_key(t: torch.Tensor):
    return (t.device.type, t.untyped_storage().data_ptr())


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


class ActivationMeter:
    """Counts bytes saved for backward inside ``with meter.measure():`` blocks.

    ``peak`` is the largest total of one block (one microbatch's forward); ``last`` the
    total of the latest block.

    The hooks run on every tensor autograd saves (a call from C++ into Python and back,
    twice per tensor, about 2% of a small GPT's step), so ``measure(key)`` measures a
    ``key`` once and reuses its bytes after: pass what decides the saved tensors (the
    input's shape and dtype; the engine passes its microbatch's ``(x.shape, x.dtype,
    y.shape)``). That is exact for a model whose saved tensors follow from the
    input's shape (every model here); a model whose saved tensors depend on the data
    (routing, ``nonzero``) must call ``measure()`` without a key. ``forget()`` drops
    what was measured. ``live`` is a set of storage addresses, kept up to date by its owner,
    that are parameters too (ZeRO stage 3 gathers a block's parameters into fresh storage each
    time). Storages are keyed by address alone (CPU and CUDA addresses do
    not overlap in one process) and each is counted once per block (a storage at a freed one's address too:
    ``_measured``).
    """

    listener = None
    """A function every tensor this meter's hooks see is passed to, whose result autograd keeps (a
    ``SavedRef``; ``memory_timeline``'s, since these hooks are the innermost while the meter measures)."""

    def __init__(self, exclude=(), live: set | None = None, storage_id=None):
        self._id = storage_id or _address  # fake tensors have no address: ``memory.fake`` keys by the storage object
        self._exclude = frozenset(self._id(p.untyped_storage()) for p in exclude)
        self._held: dict = {}
        self._live = live if live is not None else set()  # parameter storages that come and go (ZeRO-3's chunks)
        self._known: dict = {}
        self.peak = 0
        self.last = 0

    def measure(self, key=None):
        if key is not None and key in self._known:
            return self._reuse(self._known[key])
        return self._measured(key)

    @contextmanager
    def _measured(self, key):
        """Count each storage the enclosed code saves for backward once, by address, with a weak reference to the
        storage: a part of the graph whose output nobody keeps (a router's logits, discarded) lets its saved
        tensors go at once, a later storage can take a freed one's address, and it is counted as the new storage
        it is (keyed by address alone it went uncounted, and which address the allocator reused changed from run
        to run: DeepSeek-V3's MoE layers). A storage freed before the block ends still counts."""
        exclude, live, storage_id = self._exclude, self._live, self._id  # parameters are never counted
        held: dict[int, StorageWeakRef] = {}  # address -> a weak reference to the storage counted there
        self._held, self.last = held, 0
        listener = self.listener

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage_id(storage)
            if ptr not in exclude and ptr not in live:
                ref = held.get(ptr)
                if ref is None or ref.expired():  # a new storage (or a freed one's address taken again)
                    held[ptr] = StorageWeakRef(storage)
                    self.last += storage.nbytes()
                    if self.last > self.peak:
                        self.peak = self.last
            return t if listener is None else listener(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        if key is not None:
            if len(self._known) >= 64:  # shapes that keep changing: keep the table small
                self._known.clear()
            self._known[key] = self.last

    def holds(self, t: torch.Tensor) -> bool:
        """Whether the last measured block counted ``t``'s storage, and it is still alive."""
        ref = self._held.get(self._id(t.untyped_storage()))
        return ref is not None and not ref.expired()

    @contextmanager
    def _reuse(self, nbytes: int):
        self.last = nbytes
        self.peak = max(self.peak, nbytes)
        yield

    def forget(self) -> None:
        self._known.clear()

    def reset(self) -> None:
        self.peak = 0


class SavedRef:
    """What a listener's pack returns: the saved tensor, held by autograd's graph until it lets go (the
    timeline sees that moment by a finalizer on this object)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _unpack(t):
    return t.tensor if type(t) is SavedRef else t

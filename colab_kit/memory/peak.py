"""The peak of model-state bytes inside a training step, measured from outside, on any code alike.

``engine.memory()`` says what a rank holds between steps. Inside a step the picture changes
from one op to the next: ZeRO-2 makes and frees gradient buckets, FSDP2 all-gathers
parameters into fresh storage, copies gradients into reduce-scatter buffers, frees them.
``StatePeak`` is one instrument for all of them, so that colab_kit and a PyTorch peer are
measured the same way:

- when: after every op that reaches the dispatcher (``TorchDispatchMode``), so after every
  allocation, every copy into a freshly grown storage and every collective call;
- what: the storages reachable, at that moment, from the ``roots`` given (the model, the
  optimizer, the parallel part's own objects), and every storage still alive that the parallel
  machinery allocated (``MACHINERY``: colab_kit's zero, data and precision code; torch's FSDP and
  distributed optimizers), so that a buffer held only by a local variable (FSDP2's reduce-scatter
  input, a bucket on its way into a collective) is seen too. An op belongs to the machinery when
  the nearest frame on the stack outside torch's generic layers is machinery code: autograd's
  own gradients, the model's activations and the optimizer's temporaries (``torch.optim`` stops
  the search) are not. The walk enters modules (their registered parameters and children, and
  any composable-API state such as FSDP2's), optimizers (their states and the tensors they
  step), containers, and the attributes of objects of the modules in ``WALK``; a leaf tensor's
  ``.grad`` and a DTensor's local tensor are followed;
- how much: each storage once (by address), at its size now: a storage resized to 0 counts 0,
  a view counts its whole storage, nothing that is still reachable is ever left out.

Categories, by how a storage is first reached, in this order: "params" (registered by a module
or stepped by an optimizer: fp32 masters count here on both sides), "grads" (a ``.grad``),
"optimizer" (optimizer state), "other" (everything else found in the parallel parts: gradient
buckets in flight, all-gather and reduce-scatter buffers). Activations are not model states: the
autograd graph is not walked and the model's code is not machinery. What neither side can show
(gloo's internal copies inside a collective) is missing on both.

Worked example, one rank of dp=2 ZeRO-2 on a model of Psi parameters (fp32, AdamW)::

    with StatePeak(engine.module, engine.optimizer, engine.data_parallel) as meter:
        engine.train_step(batch)
    meter.peak        # e.g. 4 Psi (params) + 4 Psi / 2 (pieces) + two buckets + 8 Psi / 2 (AdamW)
    meter.at_peak     # {"params": ..., "grads": ..., "optimizer": ..., "other": ...} at that moment

In one process, a Linear of 20 parameters (80 bytes) and SGD with momentum: the gradients live
from backward to ``zero_grad()``, the momentum from the first step on:

    >>> lin = torch.nn.Linear(4, 4)
    >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    >>> with StatePeak(lin, opt) as meter:
    ...     lin(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    >>> meter.peak, meter.at_peak
    (240, {'params': 80, 'grads': 80, 'optimizer': 80, 'other': 0})
    >>> state_bytes(lin, opt)                      # held after the step
    {'params': 80, 'grads': 0, 'optimizer': 80, 'other': 0}

Sampling walks the roots after every op: a measured step runs several times slower (a GPT
d=128 x 4 step at dp=2: seconds for colab_kit, tens of seconds for FSDP2, whose walk is larger).
It is for benchmarks and tests, never on by default. ``torch.distributed._tools.mem_tracker.
MemTracker`` runs on CPU in torch 2.13 too (one iteration per tracker), but files storages by the
phase in which it meets them rather than by what holds them: for two ``Linear(64, 64)`` and AdamW
its "Optstate" peak read 99,600 B against 66,576 B of states and step counters, the step's
temporaries included.
"""
from __future__ import annotations

import sys
from collections import deque

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StatePeak", "state_bytes", "MACHINERY", "WALK"]

MACHINERY = ("colab_kit.zero.stage0", "colab_kit.zero.stage1", "colab_kit.zero.stage2", "colab_kit.zero.stage3",
             "colab_kit.zero.chunks", "colab_kit.zero.offload", "colab_kit.precision",
             "torch.distributed.fsdp", "torch.distributed._composable", "torch.distributed.optim")
"""Modules whose allocations are model-state machinery (buckets, gathered parameters, copies); not
``colab_kit.zero.optimizer``, which rebuilds the user's optimizer (its temporaries are the optimizer's)."""
WALK = MACHINERY + ("torch.optim", "torch.nn.parallel")
"""Modules whose objects' attributes are walked."""
CATEGORIES = ("params", "grads", "optimizer", "other")


try:
    from torch.distributed._composable_state import _get_module_state as _composable_state
except ImportError:  # no composable APIs in this torch
    def _composable_state(module: torch.nn.Module) -> None:  # type: ignore[misc]  # the same call, no state
        return None

_CONTAINERS = (dict, list, tuple, set, frozenset, deque)
_UNDER: dict = {}  # (module name, prefixes) -> whether the module is one of them or inside one


def _under(name: str, prefixes: tuple) -> bool:
    """``name`` is one of the modules ``prefixes`` or inside one ("colab_kit.zero.stage0", not "colab_kit.datasets")."""
    known = _UNDER.get((name, prefixes))
    if known is None:
        known = _UNDER[name, prefixes] = any(name == p or name.startswith(p + ".") for p in prefixes)
    return known

_PLAIN = (torch.Tensor, nn.Parameter)
_WANTED: dict = {}  # type -> whether the walk enters it (decided once per type)


def _wanted(kind) -> bool:
    """Whether the walk enters objects of type ``kind``: tensors, modules, optimizers, containers and the objects
    of ``WALK``'s modules, except a type that declares ``holds_no_tensors = True`` (the engine's event log)."""
    known = _WANTED.get(kind)
    if known is None:
        known = _WANTED[kind] = (not getattr(kind, "holds_no_tensors", False) and (
            issubclass(kind, (torch.Tensor, nn.Module, torch.optim.Optimizer) + _CONTAINERS)
            or _under(kind.__module__, WALK)))
    return known


def _walk(roots) -> dict:
    """{storage address: (nbytes now, category)} of every storage reachable from ``roots``, breadth first (an
    object reached twice is entered once, the first time). It runs after every op of a measured step, so its
    loop keeps to local names and one dict lookup per value."""
    found: dict = {}
    seen: set = set()
    order = CATEGORIES.index
    todo = deque((r, "params") for r in roots)
    append, known = todo.append, _WANTED.get

    def push(values, cat):
        for v in values:
            kind = type(v)
            wanted = known(kind)
            if wanted is None:
                wanted = _wanted(kind)
            if wanted and id(v) not in seen:
                append((v, cat))

    while todo:
        obj, cat = todo.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        kind = type(obj)
        if kind in _PLAIN or isinstance(obj, torch.Tensor):
            local = None if kind in _PLAIN else getattr(obj, "_local_tensor", None)  # a DTensor: this rank's piece
            if local is not None:
                append((local, cat))
            else:
                storage = obj.untyped_storage()
                key = (obj.device.type, storage.data_ptr())
                if key not in found or order(cat) < order(found[key][1]):
                    found[key] = (storage.nbytes(), cat)
            if obj.requires_grad and obj.is_leaf and obj.grad is not None:
                append((obj.grad, "grads"))
        elif isinstance(obj, nn.Module):
            push(obj._parameters.values(), "params")
            push(obj._modules.values(), "params")
            state = _composable_state(obj)
            if state is not None:
                append((state, "other"))
        elif isinstance(obj, torch.optim.Optimizer):
            push((p for g in obj.param_groups for p in g["params"]), "params")
            push(obj.state.values(), "optimizer")
            push((v for k, v in vars(obj).items() if k not in ("state", "param_groups")), "other")
        elif isinstance(obj, dict):
            push(obj.values(), cat)
        elif isinstance(obj, _CONTAINERS):
            push(obj, cat)
        else:  # an object of the machinery (WALK)
            sub = cat if cat != "params" else "other"
            attrs = getattr(obj, "__dict__", None)
            if attrs is not None:
                push(attrs.values(), sub)
            slots = getattr(kind, "__slots__", ())
            if slots:
                push((getattr(obj, n) for n in slots if hasattr(obj, n)), sub)
    return found


def machinery_module(names) -> bool:
    """Over the module names of a stack, innermost first: the nearest outside torch's generic layers
    (dispatch, autograd, functional) is machinery code; ``torch.optim`` stops the search (the optimizer's
    temporaries are not machinery)."""
    for name in names:
        if _under(name, MACHINERY):
            return True
        if not name.startswith("torch.") or _under(name, ("torch.optim",)):
            return False
    return False


def _frame_names(frame):
    while frame is not None:
        yield frame.f_globals.get("__name__", "")
        frame = frame.f_back


def _is_machinery(frame) -> bool:
    """``machinery_module`` over the live stack from ``frame`` out."""
    return machinery_module(_frame_names(frame))


def _totals(found: dict) -> dict:
    out = dict.fromkeys(CATEGORIES, 0)
    for nbytes, cat in found.values():
        out[cat] += nbytes
    return out


def state_bytes(*roots) -> dict:
    """Model-state bytes reachable from ``roots`` now, by category (the walk of ``StatePeak``)."""
    return _totals(_walk(roots))


class StatePeak(TorchDispatchMode):
    """Inside ``with StatePeak(*roots) as meter:``, the most model-state bytes reachable at once.

    ``peak`` (bytes), ``at_peak`` (its categories), ``samples`` (how many times it looked).
    """

    def __init__(self, *roots):
        super().__init__()
        self.roots = roots
        self.peak, self.at_peak, self.samples = 0, dict.fromkeys(CATEGORIES, 0), 0
        self._made: dict = {}  # storage address -> weak reference: what the machinery allocated, alive or not

    def _machinery_bytes(self, found: dict) -> int:
        total = 0
        for key, ref in list(self._made.items()):
            if ref.expired():
                del self._made[key]
            elif key not in found:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total

    def sample(self) -> int:
        found = _walk(self.roots)
        totals = _totals(found)
        totals["other"] += self._machinery_bytes(found)
        now = sum(totals.values())
        self.samples += 1
        if now > self.peak:
            self.peak, self.at_peak = now, totals
        return now

    def _note(self, args, kwargs, out) -> None:
        """Remember the storages ``out`` has that no input had: what the op allocated."""
        def keys(values):
            return {(t.device.type, t.untyped_storage().data_ptr()) for t in values
                    if isinstance(t, torch.Tensor) and getattr(t, "_local_tensor", None) is None}

        def flat(values):
            for v in values:
                if isinstance(v, (list, tuple)):
                    yield from v
                else:
                    yield v

        inputs = keys(flat(list(args) + list(kwargs.values())))
        for t in flat(out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor) and getattr(t, "_local_tensor", None) is None:
                storage = t.untyped_storage()
                key = (t.device.type, storage.data_ptr())
                ref = self._made.get(key)
                if key not in inputs and (ref is None or ref.expired()):
                    self._made[key] = StorageWeakRef(storage)

    def __enter__(self):
        self.sample()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.sample()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_machinery(sys._getframe(1)):
            self._note(args, kwargs, out)
        self.sample()
        return out

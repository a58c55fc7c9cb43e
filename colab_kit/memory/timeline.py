"""``ck.memory_timeline(engine, batch)``: one training step with the bytes this rank holds after every op,
by category, the peak marked and what was alive at it.

Every rank calls it, as it calls ``train_step``; it is a real step (the optimizer steps). After every op
that reaches the dispatcher (``TorchDispatchMode``) the timeline counts each live storage once, at its
size now, in the first category that holds it:

params       registered by the model or stepped by the optimizer (ZeRO-3: the shards, and a block's
             gathered parameters while they live; mixed precision: the fp32 masters too)
grads        a parameter's ``.grad`` and the gradient buckets or pieces
optimizer    optimizer state (Adam's moments, step counters)
activations  what autograd saved for backward in this step (``saved_tensors_hooks``), while alive
in_flight    the rest of what the parallel machinery holds or allocated (``peak.MACHINERY``):
             buckets on their way into a collective, all-gather and reduce-scatter buffers
temporaries  any other storage an op of this step allocated that is still alive: the logits, the loss,
             autograd's gradients of activations between two backward ops

The walk of the model states is ``peak``'s (the instrument the ZeRO benchmarks use); storages
are tracked by weak reference from the op that made them, so a buffer held only by a local variable is
seen. Not seen: what the backend allocates outside torch (gloo's copies), and the inputs that
``torch.utils.checkpoint`` keeps in its own holder (they count as temporaries).

Rank 0 of dp=2, the demo GPT (110,336 fp32 parameters), AdamW, 8 rows a rank, its second step::

    tl = ck.memory_timeline(engine, data.batch(1, 16))
    tl.summary()   # 'rank 0: peak 6.62 MB at op 412 of 1,087 (backward 0, aten::mm): params 0.44, grads
                   #  0.44, optimizer 0.88, activations 2.01, in_flight 0.00, temporaries 2.85 MB'
    tl.held()      # the first sample: what the step began with, = engine.memory()'s params, grads and
                   # optimizer before it; tl.series[cat][-1] the same after it
    tl.alive_at_peak[:2]   # the largest storages at the peak: [{'category': 'temporaries', 'nbytes': ...,
                           #  'op': 'aten::mm', 'shape': (8, 16, 256), ...}, ...]

Each sample walks the roots: a profiled step runs tens of times slower than a plain one (seconds for
the demo GPT). It is for looking, never on by default. On a GPU ``allocator`` has
``torch.cuda.memory_allocated()`` at every sample beside the categories (the allocator also counts
its own rounding and the backend's buffers).

On a CUDA rank the default (``method="auto"``) is CUDA's own allocator log instead, the same categories
from the blocks the allocator hands out, in the bytes requested (``colab_kit.memory.history``), without
walking the model states after every op. ``method="dispatch"`` keeps this meter there too.
"""
from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..measure import SavedRef, _unpack
from ..observe.profile import engine_phases
from .peak import _is_machinery, _walk
from .history import HISTORY_ENTRIES, dump_snapshot, history_series, record_history

__all__ = ["MemoryTimeline", "memory_timeline", "record_timeline", "timeline_figure", "CATEGORIES"]

CATEGORIES = ("params", "grads", "optimizer", "activations", "in_flight", "temporaries")
_TOP = 8  # storages listed in alive_at_peak
_HOLDER = {"params": "a parameter storage (flat, or a ZeRO chunk)", "grads": "gradient storage (a bucket)",
           "optimizer": "optimizer state", "other": "a buffer of the parallel machinery"}


@dataclass
class MemoryTimeline:
    """One rank's step, sample by sample (plain data, picklable; bytes and seconds since the step began)."""

    rank: int
    config: str
    times: list = field(default_factory=list)     # seconds since the step began, one per sample
    ops: list = field(default_factory=list)       # the op after which each sample was taken
    series: dict = field(default_factory=dict)    # category -> bytes at each sample
    phases: list = field(default_factory=list)    # (start, end, name) of the engine's compute events
    alive_at_peak: list = field(default_factory=list)
    allocator: list | None = None                 # CUDA, at each sample: memory_allocated() (dispatch), the
                                                  # requested bytes held (cuda history: the series' totals)
    loss: float | None = None
    source: str = "dispatch"                      # "dispatch" (after every op) or "cuda history" (the allocator's log)

    def totals(self) -> list:
        return [sum(self.series[c][i] for c in CATEGORIES) for i in range(len(self.times))]

    @property
    def peak_index(self) -> int:
        totals = self.totals()
        return max(range(len(totals)), key=totals.__getitem__)

    @property
    def peak(self) -> int:
        return self.totals()[self.peak_index]

    @property
    def at_peak(self) -> dict:
        i = self.peak_index
        return {c: self.series[c][i] for c in CATEGORIES}

    def held(self, index: int = 0) -> dict:
        """The categories at sample ``index`` (0: what the step began with)."""
        return {c: self.series[c][index] for c in CATEGORIES}

    def phase_at(self, index: int) -> str:
        t = self.times[index]
        for a, b, name in self.phases:
            if a <= t <= b:
                return name
        return "between phases"

    def summary(self) -> str:
        i, mb = self.peak_index, lambda b: f"{b / 1e6:.2f}"
        parts = ", ".join(f"{c} {mb(v)}" for c, v in self.at_peak.items())
        return (f"rank {self.rank}: peak {mb(self.peak)} MB at op {i:,} of {len(self.times):,} "
                f"({self.phase_at(i)}, {self.ops[i]}): {parts} MB")


class _Recorder(TorchDispatchMode):
    """Samples the categories after every op (see the module docstring)."""

    def __init__(self, roots, names: dict, cuda: bool):
        super().__init__()
        self.roots, self.names, self.cuda = roots, names, cuda
        # storages by (device, StorageImpl address): stable while a storage is resized (ZeRO-3 frees and
        # regrows its chunks in place), unlike its data's address, which the walk's ``found`` is keyed by
        self.made: dict = {}    # key -> (weak ref, op that made it, shape, dtype, by the machinery)
        self.saved: dict = {}   # key -> how many of autograd's saved tensors hold it now
        self.t0 = time.perf_counter()
        self.tl_times: list[float] = []
        self.tl_ops: list[str] = []
        self.allocator: list[int] = []
        self.series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
        self.best = -1
        self.alive_at_peak: list = []

    def saw_saved(self, t: torch.Tensor):
        """Called for every tensor autograd saves (by the timeline's hooks and the engine's meter); returns
        what the graph keeps, a ``SavedRef`` whose end (the graph let go) ends the count."""
        held = SavedRef(t)
        if getattr(t, "_local_tensor", None) is not None or t.device.type == "meta":
            return held
        storage = t.untyped_storage()
        key = (t.device.type, storage._cdata)
        self.saved[key] = self.saved.get(key, 0) + 1
        weakref.finalize(held, self._let_go, key)
        entry = self.made.get(key)
        if entry is None or entry[0].expired():  # made before the step (the batch) or by a hidden op
            self.made[key] = (StorageWeakRef(storage), "(input)", tuple(t.shape), str(t.dtype), False)
        return held

    def _let_go(self, key) -> None:
        n = self.saved.get(key, 0) - 1
        if n > 0:
            self.saved[key] = n
        else:
            self.saved.pop(key, None)

    def sample(self, op: str) -> None:
        found = _walk(self.roots)
        now = dict.fromkeys(CATEGORIES, 0)
        for nbytes, cat in found.values():
            now["in_flight" if cat == "other" else cat] += nbytes
        extra = []
        for key, (ref, made_by, shape, dtype, machinery) in list(self.made.items()):
            if ref.expired():
                del self.made[key]
                continue
            if made_by == "(input)" and key not in self.saved:
                continue  # a storage from before the step counts while the graph holds it
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if (key[0], storage.data_ptr()) in found:  # a model state (by its data's address now)
                continue
            nbytes = storage.nbytes()
            cat = "activations" if key in self.saved else "in_flight" if machinery else "temporaries"
            now[cat] += nbytes
            extra.append((nbytes, cat, made_by, shape, dtype))
        for c in CATEGORIES:
            self.series[c].append(now[c])
        self.tl_times.append(time.perf_counter() - self.t0)
        self.tl_ops.append(op)
        if self.cuda:
            self.allocator.append(torch.cuda.memory_allocated())
        total = sum(now.values())
        if total > self.best:
            self.best = total
            self.alive_at_peak = self._largest(found, extra)

    def _largest(self, found: dict, extra: list) -> list:
        rows = [{"category": "in_flight" if cat == "other" else cat, "nbytes": n,
                 "name": self.names.get(key) or _HOLDER[cat], "op": "", "shape": None, "dtype": None}
                for key, (n, cat) in found.items()]
        rows += [{"category": cat, "nbytes": n, "name": "", "op": op, "shape": shape, "dtype": dtype}
                 for n, cat, op, shape, dtype in extra]
        return sorted(rows, key=lambda r: -r["nbytes"])[:_TOP]

    def _note(self, func, args, kwargs, out) -> None:
        inputs = {(t.device.type, t.untyped_storage()._cdata) for t in _tensors((args, kwargs))}
        machinery = None
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = (t.device.type, storage._cdata)
            entry = self.made.get(key)
            if key in inputs or (entry is not None and not entry[0].expired()):
                continue
            if machinery is None:
                machinery = _is_machinery(sys._getframe(2))
            self.made[key] = (StorageWeakRef(storage), func.name(),
                              tuple(t.shape), str(t.dtype), machinery)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._note(func, args, kwargs, out)
        self.sample(func.name())
        return out


def _tensors(values):
    """The plain tensors (not DTensors, not meta) in nested args."""
    if isinstance(values, torch.Tensor):
        if getattr(values, "_local_tensor", None) is None and values.device.type != "meta":
            yield values
    elif isinstance(values, (list, tuple)):
        for v in values:
            yield from _tensors(v)
    elif isinstance(values, dict):
        for v in values.values():
            yield from _tensors(v)


def record_timeline(fn, *roots, names: dict | None = None, meter=None, device: str = "cpu"):
    """(``fn()``'s result, the ``_Recorder``) with ``fn`` run under the recorder and saved-tensor hooks.
    ``meter``: an ``ActivationMeter`` whose own hooks forward what they see (its ``listener``)."""
    rec = _Recorder(roots, names or {}, device == "cuda")

    if meter is not None:
        meter.listener = rec.saw_saved
    try:
        rec.sample("(start)")
        with torch.autograd.graph.saved_tensors_hooks(rec.saw_saved, _unpack), rec:
            out = fn()
        rec.sample("(end)")
    finally:
        if meter is not None:
            meter.listener = None
    return out, rec


def memory_timeline(engine, batch, *, local: bool | None = None, method: str = "auto",
                    snapshot: str | None = None, max_entries: int | None = None) -> MemoryTimeline:
    """One ``train_step`` of ``engine`` on ``batch`` with this rank's memory by category over the step.

    ``method``: "dispatch" samples after every op (this module's docstring; any device); "history" reads
    CUDA's allocator log (``colab_kit.memory.history``; a CUDA rank only); "auto" is "history" on a CUDA
    rank, "dispatch" elsewhere. ``snapshot`` (history only): a path, ``{rank}`` filled in, where the
    allocator's snapshot with the step's log is pickled for pytorch.org/memory_viz. ``max_entries``: the
    log's length (``history.HISTORY_ENTRIES`` by default)."""
    cuda = engine.mesh.device.type == "cuda"
    if method not in ("auto", "dispatch", "history"):
        raise ValueError(f"method={method!r}: use 'auto', 'dispatch' (after every op, any device) or 'history' "
                         "(CUDA's allocator log)")
    if method == "history" and not cuda:
        raise ValueError(f"method='history' reads CUDA's allocator log, and this engine computes on "
                         f"{engine.mesh.device}: use method='dispatch' (or 'auto', which picks it here)")
    if (snapshot is not None or max_entries is not None) and not (cuda and method != "dispatch"):
        raise ValueError("snapshot= and max_entries= are about CUDA's allocator log: they need a CUDA engine and "
                         "method 'history' or 'auto'")
    roots = (engine.module, engine.optimizer, engine.data_parallel)
    if cuda and method != "dispatch":
        rec = record_history(lambda: engine.train_step(batch, local=local), roots, engine.mesh.device,
                             max_entries or HISTORY_ENTRIES, engine.activation_meter)
        got = history_series(rec)
        if snapshot is not None:
            dump_snapshot(rec, snapshot.format(rank=engine.mesh.global_rank))
        return MemoryTimeline(engine.mesh.global_rank, engine.config.describe(), got["times"], got["ops"],
                              got["series"], phases=engine_phases(engine, rec["t0"]),
                              alive_at_peak=got["alive_at_peak"],
                              allocator=got["totals"], loss=rec["result"], source="cuda history")
    names = {(p.device.type, p.untyped_storage().data_ptr()): n for n, p in engine.module.named_parameters()}
    if cuda:
        torch.cuda.synchronize()
    loss, rec = record_timeline(lambda: engine.train_step(batch, local=local), *roots, names=names,
                                meter=engine.activation_meter, device=engine.mesh.device.type)
    tl = MemoryTimeline(engine.mesh.global_rank, engine.config.describe(), rec.tl_times, rec.tl_ops, rec.series,
                        phases=engine_phases(engine, rec.t0), alive_at_peak=rec.alive_at_peak,
                        allocator=rec.allocator if cuda else None, loss=loss)
    if not cuda:  # on a GPU the allocator's peak of the step stays (engine.memory())
        engine.step_peak = tl.peak
    return tl


_COLOURS = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b", "activations": "#e45756",
            "in_flight": "#b279a2", "temporaries": "#bab0ac"}


def timeline_figure(timelines, title: str = "Memory over one step per rank (measured)"):
    """Stacked areas of the categories over the step (MB against ms), one row per rank, the peak marked."""
    from plotly.subplots import make_subplots

    timelines = list(timelines)
    fig = make_subplots(rows=len(timelines), cols=1, shared_xaxes=False, vertical_spacing=0.08,
                        subplot_titles=[tl.summary().split(":")[0] + f": peak {tl.peak / 1e6:.2f} MB"
                                        for tl in timelines])
    for row, tl in enumerate(timelines, start=1):
        ms = [t * 1e3 for t in tl.times]
        for c in CATEGORIES:
            fig.add_scatter(x=ms, y=[b / 1e6 for b in tl.series[c]], stackgroup=f"r{row}", name=c, mode="lines",
                            line={"width": 0.5, "color": _COLOURS[c]}, legendgroup=c, showlegend=row == 1,
                            customdata=tl.ops, hovertemplate=f"{c} %{{y:.3f}} MB<br>%{{customdata}}", row=row, col=1)
        i = tl.peak_index
        fig.add_scatter(x=[ms[i]], y=[tl.peak / 1e6], mode="markers+text", text=["peak"], textposition="top center",
                        marker={"color": "black", "size": 8}, showlegend=False, row=row, col=1,
                        hovertext=tl.summary(), hoverinfo="text")
    fig.update_layout(template="plotly_white", height=160 + 220 * len(timelines), title=title)
    fig.update_xaxes(title_text="ms since the step began")
    fig.update_yaxes(title_text="MB")
    return fig

"""torch's CUDA memory history as a step's memory timeline: ``engine.memory_timeline(batch)`` on a GPU.

On a CUDA rank ``memory_timeline`` (``method="auto"`` or ``"history"``) runs the step under
``torch.cuda.memory._record_memory_history``: the caching allocator itself logs every block it hands out
and takes back, with the Python stack that asked for it. That log is the timeline: one sample per
``alloc`` and per ``free_requested`` (the moment ``torch.cuda.memory_allocated()`` drops), bytes as the
allocator counts them (blocks rounded up to 512 bytes), so the running total is ``memory_allocated()``
at every sample and its largest value is the step's ``torch.cuda.max_memory_allocated()``, to the byte:
``engine.memory()["step_peak"]``. It costs what the allocator's own bookkeeping costs (a step runs about as
fast as without it), where the dispatch-level meter (``colab_kit.memory.timeline``, the CPU method) walks
the model states after every op.

Each block takes the first category that holds it:

params, grads, optimizer, in_flight
             the block of a storage the model-state walk (``memory.peak``) finds before the step (a block
             held at its start) or after it (a block the step allocated and kept); in_flight is the
             walk's "other": the parallel machinery's buffers
activations  a block that autograd saved a tensor of (``saved_tensors_hooks``; matched by the allocator's
             own count of allocations at the moment of saving, so a reused address is never confused)
in_flight    a block allocated and freed within the step by the machinery's code (``peak.MACHINERY``,
             judged from the allocation's innermost frame outside torch): buckets, ZeRO-3's gathered
             blocks (the dispatch meter counts those as params while they live), reduce-scatter buffers
temporaries  the rest: logits, the loss, autograd's gradients of activations, the batch

Worked example, rank 0 of dp=2 on two GPUs, the demo GPT in fp32, its second step (what each call gives;
no GPU has run this yet, so the relations below are the ones ``bench/gpu_check.py`` asserts, not a
recorded output)::

    tl = engine.memory_timeline(data.batch(1, 16))      # method "history" on CUDA
    tl.source                  # 'cuda history'
    tl.allocator[-1] == torch.cuda.memory_allocated()   # True: the log's running total, to the byte
    tl.peak == engine.memory()["step_peak"]             # True: the step's max_memory_allocated()
    tl.held(0)["params"]       # the parameters' blocks: engine.memory()["params"] rounded up to 512 B a block
    tl.alive_at_peak[0]        # the largest block at the peak: {'category': ..., 'nbytes': ..., 'op': 'alloc',
                               #  'name': 'gpt.py:<line> forward' (the innermost frame outside torch), ...}
    engine.memory_timeline(data.batch(2, 16), snapshot="step-rank{rank}.pickle")  # for pytorch.org/memory_viz

Where the trace has no ``time_us`` (an older torch), samples are spread evenly over the step's wall time.
``HISTORY_ENTRIES`` bounds the log; a step that allocates more is refused with the number to pass.
Checked on a GPU by ``bench/gpu_check.py`` (check ``memory_history``); the CPU suite checks the
reading of a trace (``tests/unit/test_memory_history.py``).
"""
from __future__ import annotations

import bisect
import pickle
import time

import torch

from .peak import MACHINERY, _walk

__all__ = ["HISTORY_ENTRIES", "record_history", "history_series", "frames_machinery", "HistoryError"]

HISTORY_ENTRIES = 1_000_000
"""Entries the allocator's log keeps (a ring: the oldest go first); a step of the demo GPT makes a few thousand."""
_CATS = ("params", "grads", "optimizer", "activations", "in_flight", "temporaries")
_WALKED = {"params": "params", "grads": "grads", "optimizer": "optimizer", "other": "in_flight"}
_TOP = 8


class HistoryError(RuntimeError):
    """A memory history that cannot be read as a step's timeline (no CUDA, a log that overflowed)."""


def _module_path(filename: str) -> str:
    """'.../site-packages/torch/optim/adam.py' -> 'torch.optim.adam' (the part from the package on)."""
    path = filename.replace("\\", "/")
    for root in ("colab_kit/", "torch/"):
        i = path.rfind("/" + root)
        if i >= 0 or path.startswith(root):
            tail = path[i + 1:] if i >= 0 else path
            return tail.rsplit(".py", 1)[0].replace("/", ".")
    return path


def frames_machinery(frames) -> bool:
    """``peak._is_machinery`` over a trace entry's frames (innermost first): the nearest frame outside
    torch's generic layers is machinery code (``torch.optim`` stops the search)."""
    for frame in frames or ():
        name = _module_path(str(frame.get("filename", "")))
        if any(name == m or name.startswith(m + ".") for m in MACHINERY):
            return True
        if not name.startswith("torch.") or name.startswith("torch.optim"):
            return False
    return False


def _top_frame(frames) -> str:
    for frame in frames or ():
        name = str(frame.get("filename", ""))
        if "/torch/" not in name.replace("\\", "/"):
            return f"{name.rsplit('/', 1)[-1]}:{frame.get('line', '?')} {frame.get('name', '')}".strip()
    return ""


def _allocated(device) -> int:
    """The allocator's count of allocations so far (``allocation.all.allocated``)."""
    return torch.cuda.memory_stats_as_nested_dict(device)["allocation"]["all"]["allocated"]


def _freed(device) -> int:
    """The allocator's count of frees so far (``allocation.all.freed``: counted where it logs free_requested)."""
    return torch.cuda.memory_stats_as_nested_dict(device)["allocation"]["all"]["freed"]


def record_history(fn, roots, device, max_entries: int = HISTORY_ENTRIES, meter=None) -> dict:
    """Run ``fn()`` with the allocator's history on; what ``history_series`` reads, with ``fn``'s result
    under "result" and the end snapshot under "snapshot" (for ``torch.cuda.memory._dump_snapshot``'s viewer)."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise HistoryError("the memory history is CUDA's allocator log: this rank computes on "
                           f"{torch.device(device)}; use method='dispatch' (the dispatch-level meter) there")
    device = torch.device(device)
    torch.cuda.synchronize(device)
    saved: list = []

    live = getattr(meter, "_live", ())  # ZeRO-3's gathered parameters: params while they live, never saved

    def note(t: torch.Tensor):
        if t.device.type == "cuda" and getattr(t, "_local_tensor", None) is None:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in live:
                saved.append((_allocated(device), ptr))
        return t

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries, clear_history=True)
    if meter is not None:
        meter.listener = note
    try:
        first = torch.cuda.memory._snapshot()
        owners0 = _owners(roots, device)
        count0, freed0, held0 = _allocated(device), _freed(device), torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0_ns, t0 = time.time_ns(), time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            result = fn()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        owners1 = _owners(roots, device)
        last = torch.cuda.memory._snapshot()
        peak, held1 = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
        count1, freed1 = _allocated(device), _freed(device)
    finally:
        if meter is not None:
            meter.listener = None
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"result": result, "snapshot": last, "start_blocks": _blocks(first, index),
            "trace": last["device_traces"][index], "owners0": owners0, "owners1": owners1, "saved": saved, "count0": count0,
            "count1": count1, "freed0": freed0, "freed1": freed1, "max_entries": max_entries, "held0": held0,
            "held1": held1, "peak": peak, "t0_ns": t0_ns, "t0": t0, "wall": wall}


def _owners(roots, device) -> dict:
    """{data address: category} of the model-state storages on ``device`` that the walk finds now."""
    return {ptr: _WALKED[cat] for (dev, ptr), (_, cat) in _walk(roots).items() if dev == device.type}


def _blocks(snapshot, index: int) -> list:
    """[(address, size, frames)] of the blocks allocated on device ``index`` when ``snapshot`` was taken."""
    out = []
    for seg in snapshot["segments"]:
        if seg.get("device", index) != index:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out.append((b["address"], b["size"], b.get("frames", [])))
    return out


def history_series(rec: dict) -> dict:
    """The timeline of what ``record_history`` returned (plain data; no CUDA call): {"times", "ops",
    "series", "totals", "alive_at_peak", "peak_index"}. The step's entries are the last allocations and
    frees of the log, as many as the allocator counted during the step; a log that lost some is refused."""
    allocs = [e for e in rec["trace"] if e.get("action") == "alloc"]
    frees = [e for e in rec["trace"] if e.get("action") == "free_requested"]
    made, freed = rec["count1"] - rec["count0"], rec["freed1"] - rec["freed0"]
    if len(allocs) < made or len(frees) < freed:
        raise HistoryError(f"the allocator's log kept {len(allocs)} of the step's {made} allocations and "
                           f"{len(frees)} of its {freed} frees: record again with a larger max_entries "
                           f"(it was {rec.get('max_entries', HISTORY_ENTRIES):,})")
    allocs, frees = allocs[len(allocs) - made:], frees[len(frees) - freed:]
    step = {id(e) for e in allocs} | {id(e) for e in frees}
    alloc_index = {id(e): n for n, e in enumerate(allocs)}
    # the model states the walk found: before the step (the start's blocks) and after it (the step's
    # allocations that it did not free): an address a temporary used earlier in the step is not a state
    at: dict = {}
    for e in rec["trace"]:
        if id(e) in step:
            if e["action"] == "alloc":
                at[e["addr"]] = alloc_index[id(e)]
            else:
                at.pop(e["addr"], None)
    kept = {n for addr, n in at.items() if addr in rec["owners1"]}
    # activations: the allocation each saved tensor's storage came from (the latest at its address among
    # the allocations made before the save, counted by the allocator: an address reused is never confused)
    by_addr: dict = {}
    for n, e in enumerate(allocs):
        by_addr.setdefault(e["addr"], []).append(n)
    activation = set()
    for count, ptr in rec["saved"]:
        ns = by_addr.get(ptr, [])
        k = bisect.bisect_right(ns, count - rec["count0"] - 1) - 1
        if k >= 0:
            activation.add(ns[k])
    live: dict = {}  # address -> (category, size, label)
    now = dict.fromkeys(_CATS, 0)
    for addr, size, frames in rec["start_blocks"]:
        cat = rec["owners0"].get(addr, "temporaries")
        live[addr] = (cat, size, _top_frame(frames) or "(before the step)")
        now[cat] += size
    times, ops, series, totals = [0.0], ["(start)"], {c: [now[c]] for c in _CATS}, [sum(now.values())]
    best, at_best = totals[0], dict(live)
    for e in rec["trace"]:
        if id(e) not in step:
            continue
        if e["action"] == "alloc":
            n = alloc_index[id(e)]
            cat = ("activations" if n in activation else rec["owners1"][e["addr"]] if n in kept
                   else "in_flight" if frames_machinery(e.get("frames")) else "temporaries")
            live[e["addr"]] = (cat, e["size"], _top_frame(e.get("frames")))
            now[cat] += e["size"]
        else:
            got = live.pop(e["addr"], None)
            if got is None:  # a block the log never showed allocated: nothing the totals held
                continue
            now[got[0]] -= got[1]
        times.append(e["time_us"] if "time_us" in e else None)
        ops.append(f"{e['action']} {e['size']:,} B {_top_frame(e.get('frames'))}".strip())
        for c in _CATS:
            series[c].append(now[c])
        totals.append(sum(now.values()))
        if totals[-1] > best:
            best, at_best = totals[-1], dict(live)
    times = _seconds(times, rec["t0_ns"], rec["wall"])
    for i in range(1, len(times)):  # two clocks (the allocator's, this process's): keep the log's order
        times[i] = max(times[i], times[i - 1])
    rows = sorted(({"category": c, "nbytes": s, "name": label, "op": "alloc", "shape": None, "dtype": None}
                   for c, s, label in at_best.values()), key=lambda r: -r["nbytes"])[:_TOP]
    return {"times": times, "ops": ops, "series": series, "totals": totals, "alive_at_peak": rows,
            "peak_index": totals.index(max(totals))}


def _seconds(stamps: list, t0_ns: int, wall: float) -> list:
    """Seconds since the step began of each sample (the first is the start, 0): the log's ``time_us`` is the
    allocator's clock turned into Unix time, read against this process's ``time.time_ns()`` at the start;
    where that does not fall inside the step (another clock), the log's own spacing from its first entry;
    where the log has no clock (an older torch), the samples evenly over the step."""
    us = stamps[1:]
    if not us or any(t is None for t in us):
        return [wall * i / max(1, len(stamps) - 1) for i in range(len(stamps))]
    since = [(t * 1000 - t0_ns) / 1e9 for t in us]
    if not all(-0.01 <= x <= wall + 0.01 for x in since):
        span = max(1, us[-1] - us[0]) / 1e6
        since = [(t - us[0]) / 1e6 * min(1.0, wall / span) for t in us]
    return [0.0] + [min(max(x, 0.0), wall) for x in since]


def dump_snapshot(rec: dict, path: str) -> None:
    """The end snapshot with the step's log, as ``torch.cuda.memory._dump_snapshot`` writes it (a pickle
    that pytorch.org/memory_viz opens)."""
    with open(path, "wb") as fh:
        pickle.dump(rec["snapshot"], fh)

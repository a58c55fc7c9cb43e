"""torch's CUDA memory history as a step's memory timeline: ``ck.memory_timeline(engine, batch)`` on a GPU.

On a CUDA rank ``memory_timeline`` (``method="auto"`` or ``"history"``) runs the step under
``torch.cuda.memory._record_memory_history``: the caching allocator itself logs every block it hands out
and takes back, with the Python stack that asked for it. That log is the timeline: one sample per
``alloc`` and per ``free_requested``, in the bytes the program asked for (the log's unit: the allocator's
``requested_bytes``), so the running total is ``torch.cuda.memory_stats()["requested_bytes.all.current"]``
at every sample and its largest value that counter's peak over the step, where no freed block waits for
another stream (the counter drops when such a block's events complete, the log when it is freed).
``memory_allocated()`` and ``engine.memory()["step_peak"]`` (``max_memory_allocated()``) count the blocks,
each rounded up (to 512 bytes; a large one further where the rest of a free block was not worth splitting
off, and by the allocator's settings, ``max_split_size_mb``, ``roundup_power2_divisions``), so they read at
least as much. Unlike the dispatch-level meter (``colab_kit.memory.timeline``, the CPU method), which walks the
model states after every op, the step pays the allocator's log (with the Python stack of every allocation)
and one read of its counters for every tensor autograd saves.

The recording is turned on for the step and off after it; a recording of the caller's own is cleared.

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
temporaries  the rest: logits, the loss, autograd's gradients of activations, the batch, and with
             ``recompute=True`` what ``torch.utils.checkpoint`` keeps (its own hooks see those tensors,
             not the timeline's; the dispatch meter counts them the same way)

Worked example, rank 0 of dp=2 on two GPUs, the demo GPT in fp32, its second step (what each call gives;
no GPU has run this yet, so the relations below are the ones ``bench/gpu_check.py`` asserts, not a
recorded output)::

    tl = ck.memory_timeline(engine, data.batch(1, 16))      # method "history" on CUDA
    tl.source                  # 'cuda history'
    stats = torch.cuda.memory_stats()
    tl.allocator[-1] == stats["requested_bytes.all.current"]   # True: the log's running total, to the byte
    tl.peak == stats["requested_bytes.all.peak"]        # True: the step's peak of requested bytes
    tl.peak <= engine.memory()["step_peak"]             # the allocator's blocks, rounded up
    tl.held(0)["params"] == engine.memory()["params"]   # the parameters' storages, as requested
    tl.alive_at_peak[0]        # the largest block at the peak: {'category': ..., 'nbytes': ..., 'op': 'alloc',
                               #  'name': 'gpt.py:<line> forward' (the innermost frame outside torch), ...}
    ck.memory_timeline(engine, data.batch(2, 16), snapshot="step-rank{rank}.pickle")  # for pytorch.org/memory_viz

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

from .peak import _walk, machinery_module

__all__ = ["HISTORY_ENTRIES", "record_history", "history_series", "frames_machinery", "HistoryError"]

HISTORY_ENTRIES = 1_000_000
"""Entries the allocator's log keeps (a ring: the oldest go first); a step of the demo GPT makes a few thousand."""
_CATS = ("params", "grads", "optimizer", "activations", "in_flight", "temporaries")
_WALKED = {"params": "params", "grads": "grads", "optimizer": "optimizer", "other": "in_flight"}
_TOP = 8


class HistoryError(RuntimeError):
    """A memory history that cannot be read as a step's timeline (no CUDA, a log that overflowed)."""


def _module_path(filename: str) -> str:
    """'.../site-packages/torch/optim/adam.py' -> 'torch.optim.adam': from the last "/colab_kit/" or "/torch/"
    in the path on (a checkout named colab_kit can hold a virtual environment with torch inside it)."""
    path = "/" + filename.replace("\\", "/").lstrip("/")
    i = max(path.rfind("/colab_kit/"), path.rfind("/torch/"))
    return path[i + 1:].rsplit(".py", 1)[0].replace("/", ".") if i >= 0 else path


def frames_machinery(frames) -> bool:
    """``peak.machinery_module`` over a trace entry's frames (innermost first), named from their files."""
    return machinery_module(_module_path(str(frame.get("filename", ""))) for frame in frames or ())


def _top_frame(frames) -> str:
    for frame in frames or ():
        name = str(frame.get("filename", ""))
        if "/torch/" not in name.replace("\\", "/"):
            return f"{name.rsplit('/', 1)[-1]}:{frame.get('line', '?')} {frame.get('name', '')}".strip()
    return ""


def _counts(device) -> tuple[int, int]:
    """(allocations, frees) the allocator counted so far: it counts them where it logs ``alloc`` and
    ``free_requested``."""
    got = torch.cuda.memory_stats_as_nested_dict(device)["allocation"]["all"]
    return got["allocated"], got["freed"]


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
                saved.append((_counts(device)[0], ptr))
        return t

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries, clear_history=True)
    if meter is not None:
        meter.listener = note
    try:
        count0, freed0 = _counts(device)  # the log begins here (cleared): its entries from this count on
        first = torch.cuda.memory._snapshot()
        owners0 = _owners(roots, device)
        torch.cuda.reset_peak_memory_stats(device)
        t0_ns, t0 = time.time_ns(), time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            result = fn()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        count1, freed1 = _counts(device)  # the step's: the log's first count1 - count0 allocations
        owners1 = _owners(roots, device)
        count2, freed2 = _counts(device)  # what the log must hold, whole
        last = torch.cuda.memory._snapshot()
    finally:
        if meter is not None:
            meter.listener = None
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"result": result, "snapshot": last, "start_blocks": _blocks(first, index),
            "trace": last["device_traces"][index], "owners0": owners0, "owners1": owners1, "saved": saved,
            "count0": count0, "count1": count1, "count2": count2, "freed0": freed0, "freed1": freed1,
            "freed2": freed2, "max_entries": max_entries, "t0_ns": t0_ns, "t0": t0, "wall": wall}


def _owners(roots, device) -> dict:
    """{data address: category} of the model-state storages on ``device`` that the walk finds now."""
    return {ptr: _WALKED[cat] for (dev, ptr), (_, cat) in _walk(roots).items() if dev == device.type}


def _blocks(snapshot, index: int) -> list:
    """[(address, requested bytes, frames)] of the blocks allocated on device ``index`` when ``snapshot`` was
    taken (the bytes asked for, the log's unit; the block itself is rounded up)."""
    out = []
    for seg in snapshot["segments"]:
        if seg.get("device", index) != index:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out.append((b["address"], b.get("requested_size", b["size"]), b.get("frames", [])))
    return out


def history_series(rec: dict) -> dict:
    """The timeline of what ``record_history`` returned (plain data; no CUDA call): {"times", "ops",
    "series", "totals", "alive_at_peak", "peak_index"}, bytes as requested (the log's unit). The log begins
    when the recording does (``clear_history``); the step's entries are its first allocations and frees, as
    many as the allocator counted during the step; a log that does not hold every one the allocator counted
    while it recorded (its ring dropped the oldest) is refused."""
    allocs = [e for e in rec["trace"] if e.get("action") == "alloc"]
    frees = [e for e in rec["trace"] if e.get("action") == "free_requested"]
    logged, logged_frees = rec["count2"] - rec["count0"], rec["freed2"] - rec["freed0"]
    if len(allocs) < logged or len(frees) < logged_frees:
        raise HistoryError(f"the allocator's log kept {len(allocs)} of the {logged} allocations and {len(frees)} of "
                           f"the {logged_frees} frees counted while it recorded: record again with a larger "
                           f"max_entries (it was {rec.get('max_entries', HISTORY_ENTRIES):,})")
    if len(allocs) > logged or len(frees) > logged_frees:
        raise HistoryError(f"the allocator's log holds {len(allocs)} allocations and {len(frees)} frees where its "
                           f"counters moved by {logged} and {logged_frees}: another thread used the allocator while "
                           "the step was recorded; record again, or use method='dispatch'")
    allocs, frees = allocs[:rec["count1"] - rec["count0"]], frees[:rec["freed1"] - rec["freed0"]]
    keep = {id(x) for x in allocs} | {id(x) for x in frees}
    step = [e for e in rec["trace"] if id(e) in keep]
    alloc_index = {id(e): n for n, e in enumerate(allocs)}
    # the model states the walk found: before the step (the start's blocks) and after it (the step's
    # allocations that it did not free): an address a temporary used earlier in the step is not a state
    at: dict = {}
    for e in step:
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
    start = {addr: (rec["owners0"].get(addr, "temporaries"), size, _top_frame(frames) or "(before the step)")
             for addr, size, frames in rec["start_blocks"]}
    label = {}  # alloc index -> (category, size, label)
    for e in step:
        if e["action"] == "alloc":
            n = alloc_index[id(e)]
            cat = ("activations" if n in activation else rec["owners1"][e["addr"]] if n in kept
                   else "in_flight" if frames_machinery(e.get("frames")) else "temporaries")
            label[n] = (cat, e["size"], _top_frame(e.get("frames")))

    def replay(upto: int):
        """The live blocks after the first ``upto`` of the step's entries: address -> (category, size, label)."""
        live = dict(start)
        for e in step[:upto]:
            if e["action"] == "alloc":
                live[e["addr"]] = label[alloc_index[id(e)]]
            else:
                live.pop(e["addr"], None)
        return live

    live = dict(start)
    now = dict.fromkeys(_CATS, 0)
    for cat, size, _ in start.values():
        now[cat] += size
    stamps: list[float | None] = [0.0]  # the log's time_us (None where it has none), made into seconds below
    ops, series, totals = ["(start)"], {c: [now[c]] for c in _CATS}, [sum(now.values())]
    upto = [0]  # per sample: how many of the step's entries it follows
    for i, e in enumerate(step, start=1):
        if e["action"] == "alloc":
            cat, size, _ = live[e["addr"]] = label[alloc_index[id(e)]]
            now[cat] += size
        else:
            got = live.pop(e["addr"], None)
            if got is None:  # a block the log never showed allocated: nothing the totals held
                continue
            now[got[0]] -= got[1]
        upto.append(i)
        stamps.append(e["time_us"] if "time_us" in e else None)
        ops.append(f"{e['action']} {e['size']:,} B {_top_frame(e.get('frames'))}".strip())
        for c in _CATS:
            series[c].append(now[c])
        totals.append(sum(now.values()))
    peak = totals.index(max(totals))
    at_peak = replay(upto[peak])  # rebuilt once, not copied at every new high
    times = _seconds(stamps, rec["t0_ns"], rec["wall"])
    for i in range(1, len(times)):  # two clocks (the allocator's, this process's): keep the log's order
        times[i] = max(times[i], times[i - 1])
    rows = sorted(({"category": c, "nbytes": n, "name": where, "op": "alloc", "shape": None, "dtype": None}
                   for c, n, where in at_peak.values()), key=lambda r: -r["nbytes"])[:_TOP]
    return {"times": times, "ops": ops, "series": series, "totals": totals, "alive_at_peak": rows,
            "peak_index": peak}


def _seconds(stamps: list, t0_ns: int, wall: float) -> list[float]:
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

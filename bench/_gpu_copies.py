"""Offload's copies on a side stream, and host syncs per step: the GPU check's ``offload_copies`` check and
``bench/zero_streams.py``.

``offload_copies`` trains ZeRO-3 with ``offload="cpu"`` in bf16 (every chunk on the host, its shard pinned) on
one rank twice from the same weights: with the copies on the compute stream, the copies back blocking the host
(``COLAB_KIT_COPIES=inline``), and on side streams ordered by events (``stream``, the default on a GPU). The two
engines take turns step by step, so the machine's noise hits both alike. Recorded per mode: the losses (the same
bit for bit on CPU; on a GPU within 2^-6, as FlashAttention's backward is not bit-reproducible run to run), the
median step time after the first, the copies made, and the host syncs of one step
(``torch.cuda.set_sync_debug_mode("warn")``, by line). In stream mode one step runs under ``torch.profiler``:
the share of the copies' time (``Memcpy HtoD/DtoH``) that ran while a compute kernel ran, the profile that shows
the copies beside compute. The CPU smoke runs ``now`` against ``lazy`` (CUDA's ordering played on CPU) and
checks the losses only::

    python bench/zero_streams.py          # on a GPU: the two modes side by side, their ratio printed
"""
from __future__ import annotations

import collections
import math
import os
import statistics
import time
import traceback
import warnings

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.reference import max_relative_difference
from colab_kit.models import GPT, GPTConfig
from colab_kit.observe.profile import _union as union  # (start, end) intervals merged where they overlap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGING = os.path.join("colab_kit", "comm", "rules", "staging.py")
STREAMS_SIZES = {  # ``bench/zero_streams.py``: the GPU check's ZeRO-3 model (109M) on a GPU, a tiny one on CPU
    "cuda": dict(zero=dict(vocab_size=4096, seq_len=256, d_model=1024, n_heads=16, n_layers=8), zero_batch=8,
                 zero_steps=5),
    "cpu": dict(zero=dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2), zero_batch=8, zero_steps=4),
}


def host_syncs(step) -> dict | None:
    """Run ``step()`` on a GPU under ``torch.cuda.set_sync_debug_mode("warn")``: every device -> host sync it
    made, by the innermost line of this checkout that made it (not torch's wrapper); ``staged``: those made by several ranks sharing the GPU
    (``comm/rules/staging.py``), which a run on NCCL does not make. None without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        step()
        return None
    torch.cuda.synchronize()
    sites: collections.Counter = collections.Counter()

    def seen(message, category, filename, lineno, file=None, line=None):  # the line of ours that made the sync:
        if "synchroniz" not in str(message):  # torch's own Python wrappers (Stream.synchronize) are skipped
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(ROOT + os.sep)
                and "site-packages" not in f.filename and not f.filename.endswith("_gpu_copies.py")]
        where = ours[-1] if ours else None
        sites[f"{os.path.relpath(where.filename, ROOT)}:{where.lineno}" if where else
              f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    staged = sum(n for k, n in sites.items() if k.startswith(STAGING))
    return {"syncs": sum(sites.values()), "staged": staged, "sites": dict(sites.most_common())}


def busy_seconds(prof) -> float:
    """From a CUDA profile: the seconds the GPU ran anything (the union of its kernels' and copies' intervals),
    the step's time less the GPU's idle gaps."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
             and not getattr(e, "is_user_annotation", False)]
    return sum(b - a for a, b in union(spans)) / 1e6


def copy_overlap(prof) -> dict:
    """From a CUDA profile: the copies' microseconds (host <-> device memcpy) and how many of them ran while a
    compute kernel ran (the union of the kernels' intervals; NCCL's kernels and annotations are not compute)."""
    copies, kernels = [], []
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue  # a record_function range shown on the GPU's timeline is no kernel
        span = (e.time_range.start, e.time_range.end)
        if "Memcpy HtoD" in e.name or "Memcpy DtoH" in e.name:
            copies.append(span)
        elif "Memcpy" not in e.name and "Memset" not in e.name and not e.name.startswith("nccl"):
            kernels.append(span)
    merged = union(kernels)
    total = sum(b - a for a, b in copies)
    beside = sum(max(0.0, min(b, kb) - max(a, ka)) for a, b in copies for ka, kb in merged)
    return {"copies": len(copies), "copy_us": total, "beside_compute_us": beside,
            "beside_share": beside / total if total else None}


def rank_offload_copies(model: dict, batch: int, steps: int, modes: tuple[str, ...]) -> dict:
    cfg = GPTConfig(**model)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1)
    engines = {}
    for mode in modes:
        os.environ["COLAB_KIT_COPIES"] = mode  # read when the engine's placement makes its Copies
        torch.manual_seed(0)
        engines[mode] = ck.boost(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 ck.ParallelConfig(zero=3, offload="cpu", precision="bf16"))
    os.environ.pop("COLAB_KIT_COPIES", None)
    out = {m: {"losses": [], "seconds": [], "mode": e.data_parallel.placement.copies.mode} for m, e in engines.items()}
    for s in range(steps):
        for mode in (modes if s % 2 == 0 else modes[::-1]):
            t0 = time.perf_counter()
            out[mode]["losses"].append(engines[mode].train_step(data.batch(s, batch)))  # a float: the step is done
            out[mode]["seconds"].append(time.perf_counter() - t0)
    for mode, engine in engines.items():
        r = out[mode]
        r["median_step_s"] = statistics.median(r["seconds"][1:]) if len(r["seconds"]) > 1 else r["seconds"][0]
        r["syncs"] = host_syncs(lambda: engine.train_step(data.batch(steps, batch)))
        r["copies_per_step"] = {k: v // (steps + 1) for k, v in engine.data_parallel.placement.copies.counts.items()}
        if mode == "stream" and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.train_step(data.batch(steps + 1, batch))
            r["profile"] = copy_overlap(prof)
        engine.close()
    return {"model": model, "batch": batch, "steps": steps, "modes": out}


def check_offload_copies(ctx, launch) -> tuple[bool, dict, str]:
    """The GPU check's ``offload_copies`` (module docstring); ``launch(ctx, fn, world, *args)``."""
    modes = ("inline", "stream") if ctx["cuda"] else ("now", "lazy")
    sizes = ctx["sizes"]
    r = launch(ctx, rank_offload_copies, 1, sizes["zero"], sizes["zero_batch"], sizes["zero_steps"] + 1, modes)[0]
    before, after = (r["modes"][m] for m in modes)
    rel = max_relative_difference(after["losses"], before["losses"])
    # on CPU the same bits; on a GPU FlashAttention's backward adds dq atomically, in no fixed order, so two
    # engines of the same weights drift apart by bf16 rounding from step to step, copies or not
    same = all(math.isfinite(x) for x in after["losses"]) and rel <= (0.0 if not ctx["cuda"] else 2.0 ** -6)
    ratio = before["median_step_s"] / after["median_step_s"]
    r.update(same_losses=same, max_rel=rel, speedup=ratio)
    detail = (f"bf16 zero=3 offload=cpu, {modes[0]} {before['median_step_s'] * 1e3:.1f} ms vs {modes[1]} "
              f"{after['median_step_s'] * 1e3:.1f} ms a step ({ratio:.2f}x); losses' max rel difference {rel:.1e}")
    if ctx["cuda"]:
        prof, syncs = after.get("profile") or {}, [before["syncs"], after["syncs"]]
        detail += (f"; host syncs a step {syncs[0] and syncs[0]['syncs']} -> {syncs[1] and syncs[1]['syncs']}; "
                   f"copies beside compute {prof.get('beside_share') or 0:.0%} of {prof.get('copy_us', 0) / 1e3:.1f} ms")
    return same, r, detail

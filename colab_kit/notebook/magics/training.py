"""What a ``%%colossal`` cell trained: one line per engine whose step count moved, printed after the cell.

With a cell, the magic asks rank 0 for every ``Engine`` in its namespace that took steps since the last time
it was asked (the question sent right behind the cell's code, so it costs no round trip of its own), and
prints, beside the loss, the recipe and the speed::

    engine: steps 11-30 · loss 3.104 -> 2.447 · grad norm 0.713 (under the clip at 1) · lr 2.30e-03
            · 70,521 tokens/s · 1.64 GFLOP/step · MFU 6.7% of 212 GFLOP/s measured peak

The grad norm is the last step's global norm before clipping (``engine.records``), the lr the first
param group's; tokens/s and MFU come from ``engine.throughput`` over the cell's steps (the matmul peak
is measured on rank 0 once and cached). A cell that trained nothing prints nothing.
"""
from __future__ import annotations

import math
import weakref

from ...observe.throughput import engine_throughput, format_throughput
from colab_kit.engine.core import Engine
from colab_kit.notebook.cluster.remote import namespace

__all__ = ["ask_training", "rank_training", "summary_lines"]


SUMMARIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""On a rank: per engine, how many of its steps the cell line has shown already."""


def rank_training() -> list[dict]:
    """On a rank: per engine in the namespace that stepped since last asked, what the line shows."""
    out = []
    for name, eng in list(namespace().items()):
        if not isinstance(eng, Engine) or name.startswith("_") or eng.closed:
            continue
        seen = SUMMARIZED.get(eng, 0)
        now = eng.steps_run  # steps run here, not the ones a loaded checkpoint brought
        SUMMARIZED[eng] = now
        if now <= seen or not eng.records:
            continue
        recs = eng.records[-min(now - seen, len(eng.records)):]
        speed = None
        try:
            speed = engine_throughput(eng, last=len(recs))
        except (ValueError, KeyError, TypeError):  # records without timings (a loaded run's first steps)
            pass
        out.append({"name": name, "first": recs[0]["step"], "last": recs[-1]["step"],
                    "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"],
                    "grad_norm": recs[-1].get("grad_norm"), "max_grad_norm": eng.max_grad_norm,
                    "lr": recs[-1].get("lr"), "skipped": sum(bool(r.get("skipped")) for r in recs),
                    "throughput": speed})
    return out


def format_summary(s: dict) -> str:
    """The line of one engine (see the module docstring)."""
    steps = f"step {s['last']}" if s["first"] == s["last"] else f"steps {s['first']}-{s['last']}"
    parts = [f"{s['name']}: {steps}", f"loss {s['loss_first']:.4g} -> {s['loss_last']:.4g}"
             if s["first"] != s["last"] else f"loss {s['loss_last']:.4g}"]
    norm, clip = s["grad_norm"], s["max_grad_norm"]
    if norm is not None:
        if not math.isfinite(norm):
            note = " (not finite)"
        elif clip is None:
            note = ""
        else:
            note = f" (clipped to {clip:g})" if norm > clip else f" (under the clip at {clip:g})"
        parts.append(f"grad norm {norm:.3g}{note}")
    if s["lr"] is not None:
        parts.append(f"lr {s['lr']:.2e}")
    if s["skipped"]:
        parts.append(f"{s['skipped']} fp16 step(s) skipped")
    if s["throughput"] is not None:
        parts.append(format_throughput(s["throughput"]))
    return " · ".join(parts)


def ask_training(cluster):
    """Send ``rank_training`` to rank 0 now (``Cluster.submit``): sent while a cell's code is on its way, it
    runs right behind the cell on rank 0, so its answer comes back with the cell's instead of in a second
    round trip after it. None when it cannot be sent (the summary is never why a cell fails)."""
    try:
        return cluster.submit(rank_training, rank=0)
    except Exception:  # noqa: BLE001 - a summary never turns a cell that ran into a failure
        return None


def summary_lines(cluster, asked) -> list[str]:
    """What the last cell trained, one line per engine: rank 0's answer to ``asked`` (``ask_training``, sent
    behind the cell); nothing where nothing was asked (a cell on ranks without 0) or rank 0 cannot answer."""
    if asked is None:
        return []
    try:
        got = cluster.collect(asked, timeout=60)
    except Exception:  # noqa: BLE001 - a summary never turns a cell that ran into a failure
        return []
    return [format_summary(s) for s in got or []]

"""What a ``%%colossal`` cell trained: one line per engine whose step count moved, printed after the cell.

With a cell, the magic asks rank 0 for every ``Engine`` in its namespace that took steps since the last time
it was asked (the question sent right behind the cell's code, so it costs no round trip of its own), and
prints, beside the loss, the recipe and the speed::

    engine: steps 11-30 · loss 3.104 -> 2.447 · grad norm 0.713 (under the clip at 1) · lr 2.30e-03
            · 70,521 tokens/s · 1.64 GFLOP/step · MFU 6.7% of 212 GFLOP/s measured peak

The grad norm is the last step's global norm before clipping (``engine.records``), the lr the first
param group's; tokens/s and MFU come from ``engine.throughput`` over the cell's steps (the matmul peak
is measured on rank 0 once and cached). A cell that trained nothing prints nothing.

An engine with mixture-of-experts layers adds a second line, from the MoE records of the same steps on rank 0
(``colab_kit.observe.moe.moe_summary``: no collective of its own)::

            moe (2 layers): busiest expert 1.16x -> 1.33x the mean · dropped 17.8% of 40,960 assignments
            · balance 1.002 -> 1.045 · z 2 -> 2.11 · rank 0 dispatched 120.6 KiB/step, 91.7 KiB to other ranks

(notebook 09's MoE GPT, 20 steps at dp=4 ep=4 with the router bias on; printed as one line)

"busiest expert" is the largest load over the mean load of any layer at the first and the last step
(1.00x: balanced); "dropped" counts the assignments a capacity dropped over the cell's steps; balance and z
are the layers' mean balancing and z losses before their coefficients (the balance of a uniform router is
1); the dispatch part (with ``ep``) is rank 0's bytes sent per step, all layers. With pp, rank 0 records the
MoE layers of its own stage only, and the line says "on rank 0's stage" (or that rank 0's stage has none).
"""
from __future__ import annotations

import math
import weakref

from ...config import Axis
from ...mesh import MeshLayout
from ...observe.moe import moe_summary
from ...observe.throughput import engine_throughput, format_throughput
from colab_kit.engine.core import Engine
from colab_kit.notebook.cluster.remote import namespace

__all__ = ["ask_training", "rank_training", "summary_lines", "format_summary", "format_moe"]


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
                    "throughput": speed, "moe": _moe(eng, recs)})
    return out


def _moe(eng, recs) -> dict | None:
    """The MoE part of the line, from this rank's records of the cell's steps (None: no MoE layer)."""
    cfg = eng.config
    if not any(r.get("moe") for r in recs):  # no MoE layer, or (pp) none on this rank's stages
        return {"elsewhere": cfg.pp} if cfg.pp > 1 and any("moe" in r for r in recs) else None
    ep_rank = MeshLayout(cfg).all_coords(eng.mesh.global_rank).get(Axis.EP) if getattr(cfg, "ep", 1) > 1 else None
    out = moe_summary(recs, ep_rank)
    if out is not None:
        out["stage_only"] = cfg.pp > 1
    return out


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def format_moe(m: dict) -> str:
    """The MoE line of one engine (see the module docstring).

    >>> line = format_moe({"layers": 2, "busiest_first": 1.52, "busiest_last": 1.18, "dropped": 240,
    ...                    "assigned": 7680, "balance_first": 1.012, "balance_last": 1.001, "z_first": 1.97,
    ...                    "z_last": 1.91, "sent": 7168, "sent_off": 5222.4})
    >>> print(*line.split(" · "), sep=chr(10))
    moe (2 layers): busiest expert 1.52x -> 1.18x the mean
    dropped 3.1% of 7,680 assignments
    balance 1.012 -> 1.001
    z 1.97 -> 1.91
    rank 0 dispatched 7.0 KiB/step, 5.1 KiB to other ranks
    >>> print(format_moe({"elsewhere": 2}))
    moe: no MoE layer on rank 0's stage (pp=2): %colossal moe reads every stage's
    """
    if "elsewhere" in m:
        return f"moe: no MoE layer on rank 0's stage (pp={m['elsewhere']}): %colossal moe reads every stage's"
    def moved(key: str, fmt: str, suffix: str = "") -> str:
        a, b = m[f"{key}_first"], m[f"{key}_last"]
        return f"{a:{fmt}}{suffix}" if a == b else f"{a:{fmt}}{suffix} -> {b:{fmt}}{suffix}"

    where = "on rank 0's stage" if m.get("stage_only") else ""
    layers = f"{m['layers']} layer{'s' if m['layers'] != 1 else ''}{' ' + where if where else ''}"
    share = 100 * m["dropped"] / m["assigned"] if m["assigned"] else 0.0
    parts = [f"moe ({layers}): busiest expert {moved('busiest', '.2f', 'x')} the mean",
             f"dropped {share:.1f}% of {m['assigned']:,} assignments" if m["dropped"] else "nothing dropped",
             f"balance {moved('balance', '.4g')}", f"z {moved('z', '.3g')}"]
    if m.get("sent") is not None:
        parts.append(f"rank 0 dispatched {_size(m['sent'])}/step, {_size(m['sent_off'])} to other ranks")
    return " · ".join(parts)


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
    lines = []
    for s in got or []:
        lines.append(format_summary(s))
        if s.get("moe"):
            lines.append(" " * 8 + format_moe(s["moe"]))
    return lines

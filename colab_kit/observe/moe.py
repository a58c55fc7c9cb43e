"""What the MoE records of an engine say over several steps: the load per expert and the cell's summary.

Pure functions over ``engine.records`` (one rank's list of step dicts, each with ``"moe"``: one dict per MoE
layer of the rank, ``colab_kit.expert.records``); no processes, no plotly. ``loads_by_layer`` shapes the
records for the load heatmap (``colab_kit.viz.moe``), ``moe_summary`` for the line a ``%%colossal`` cell prints
after it trained (``colab_kit.notebook.magics.training``). Worked example, two steps of one layer of 4 experts
(top-2, 16 tokens: 32 assignments a step)::

    recs = [{"step": 1, "moe": [{"layer": 1, "counts": [14, 6, 6, 6], "dropped": 4, "balance": 1.2, "z": 3.0}]},
            {"step": 2, "moe": [{"layer": 1, "counts": [10, 8, 7, 7], "dropped": 1, "balance": 1.05, "z": 2.8}]}]
    loads_by_layer(recs)
    # {1: {"steps": [1, 2], "counts": [[14, 6, 6, 6], [10, 8, 7, 7]], "dropped": [4, 1]}}
    moe_summary(recs)
    # {"layers": 1, "busiest_first": 1.75, "busiest_last": 1.25,   # max count / mean count (8): 14/8, 10/8
    #  "dropped": 5, "assigned": 64,                              # 7.8% of the cell's assignments dropped
    #  "balance_first": 1.2, "balance_last": 1.05, "z_first": 3.0, "z_last": 2.8, "sent": None, "sent_off": None}

With expert parallelism each layer's record also holds ``"sent"`` (bytes this rank dispatched to each of its
ep group's ranks); ``moe_summary(recs, ep_rank=0)`` then adds ``"sent"`` (bytes per step, mean over the steps,
all layers) and ``"sent_off"`` (the part that left the rank: every ep rank but ``ep_rank``).
"""
from __future__ import annotations

__all__ = ["loads_by_layer", "moe_summary", "busiest"]


def busiest(counts) -> float:
    """The busiest expert's assignments over the mean (1.0: balanced; E: every assignment to one expert).

    >>> busiest([14, 6, 6, 6])
    1.75
    """
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0


def loads_by_layer(records) -> dict[int, dict]:
    """Per MoE layer (by its number in the model), its steps, counts per expert and drops (module docstring).
    Steps without MoE records (a dense model, a loaded checkpoint's first steps) are left out."""
    out: dict[int, dict] = {}
    for rec in records:
        for layer in rec.get("moe") or ():
            row = out.setdefault(layer["layer"], {"steps": [], "counts": [], "dropped": []})
            row["steps"].append(rec["step"])
            row["counts"].append(list(layer["counts"]))
            row["dropped"].append(layer["dropped"])
    return dict(sorted(out.items()))


def _per_step(rec: dict, ep_rank: int | None) -> dict:
    layers = rec["moe"]
    sent = [sum(layer.get("sent", [])) for layer in layers]
    off = [sum(b for k, b in enumerate(layer.get("sent", [])) if k != ep_rank) for layer in layers]
    return {"busiest": max(busiest(layer["counts"]) for layer in layers),
            "dropped": sum(layer["dropped"] for layer in layers),
            "assigned": sum(sum(layer["counts"]) for layer in layers),
            "balance": sum(layer["balance"] for layer in layers) / len(layers),
            "z": sum(layer["z"] for layer in layers) / len(layers),
            "sent": sum(sent) if any("sent" in layer for layer in layers) else None, "sent_off": sum(off)}


def moe_summary(records, ep_rank: int | None = None) -> dict | None:
    """What the cell line shows of ``records`` (the steps a cell ran), or None when none has MoE records.

    busiest: over the layers, the busiest expert's load over the mean (first and last step); dropped and
    assigned: the steps' sums over the layers (assignments before the capacity); balance and z: the mean over
    the layers, before their coefficients, whole batch (first and last step); sent, sent_off: bytes per step
    this rank dispatched, and the part to other ep ranks (None without ep)."""
    steps = [_per_step(r, ep_rank) for r in records if r.get("moe")]
    if not steps:
        return None
    first, last = steps[0], steps[-1]
    with_ep = [s for s in steps if s["sent"] is not None]
    layers = {layer["layer"] for r in records for layer in r.get("moe") or ()}
    return {"layers": len(layers), "busiest_first": first["busiest"], "busiest_last": last["busiest"],
            "dropped": sum(s["dropped"] for s in steps), "assigned": sum(s["assigned"] for s in steps),
            "balance_first": first["balance"], "balance_last": last["balance"],
            "z_first": first["z"], "z_last": last["z"],
            "sent": sum(s["sent"] for s in with_ep) / len(with_ep) if with_ep else None,
            "sent_off": sum(s["sent_off"] for s in with_ep) / len(with_ep) if with_ep else None}

"""``ck.plan(..., exact=k)``: the first k candidates that fit, their model states made exact by dry runs.

Each chosen candidate's pipeline stages are dry-run on their first rank (``ck.dry_run``: built under torch's
fake process group, one process for all of them); its memory becomes that of its fullest rank (model states
plus the activations the engine's estimate gives that rank: a dry run takes no step): params, grads and
optimizer bytes on the device and the host exact to the byte, the activations that rank's estimate. One rank's
figures, not the worst states of one stage beside the worst activations of another: with pp the first stage
holds the most activations, the last one the head. ``fits`` is decided again, and ``plan`` ranks the list
again.
"""
from __future__ import annotations
from ...engine.core import unsupported
from .run import dry_run_many

__all__ = ["exact_states"]


def exact_states(cands, model, batch, seq, optimizer, policy, count, memory_per_rank) -> list:
    """The first ``count`` candidates that fit, their model states replaced by the dry runs' exact bytes; a
    candidate the engine does not run (a bf16 expert-parallel layout priced at a preset) keeps its estimate."""
    chosen = [c for c in cands if c.fits and c.config.offload != "auto" and unsupported(c.config) is None][:count]
    calls = []
    for c in chosen:
        cfg = c.config
        stage = cfg.world_size // cfg.pp  # ranks per pipeline stage: stage s begins at s * stage
        ranks = sorted({s * stage for s in range(cfg.pp)})
        calls.append({"model": model, "config": cfg, "rank": ranks, "batch": batch, "seq": seq,
                      "optimizer": optimizer, "policy": policy})
    reports = dry_run_many(calls, hardware=()) if calls else []
    at = 0
    for c, call in zip(chosen, calls):
        mine, at = reports[at:at + len(call["rank"])], at + len(call["rank"])
        keys = ("params", "grads", "optimizer")
        full = max(mine, key=lambda r: sum(r.memory[k] for k in keys) + r.memory["activations"])
        acts = full.memory["activations"] or c.memory["activations"]  # 0: a model the estimate cannot walk
        c.memory = {**{k: full.memory[k] for k in keys}, "activations": acts,  # where each lies, as the rank said
                    "device": {**{k: full.memory["device"][k] for k in keys}, "activations": acts},
                    "host": {**{k: full.memory["host"][k] for k in keys}, "activations": 0}}
        c.dry_runs = mine
        c.fits = memory_per_rank is None or c.device_bytes <= memory_per_rank
    return list(cands)

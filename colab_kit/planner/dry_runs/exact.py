"""``ck.plan(..., exact=k)``: the first k candidates that fit, their model states made exact by dry runs.

Each chosen candidate's pipeline stages are dry-run on their first rank (``ck.dry_run``: built under torch's
fake process group, one process for all of them); its params, grads and optimizer bytes, on the device and
the host, become those of its fullest rank, exact to the byte; the activations stay the estimate (a dry run
takes no step), and ``fits`` is decided again. ``plan`` then ranks the list again.
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
        full = max(mine, key=lambda r: sum(r.memory[k] for k in ("params", "grads", "optimizer")))
        keys, acts = ("params", "grads", "optimizer"), c.memory["activations"]
        c.memory = {**{k: full.memory[k] for k in keys}, "activations": acts,  # where each lies, as the rank said
                    "device": {**{k: full.memory["device"][k] for k in keys}, "activations": acts},
                    "host": {**{k: full.memory["host"][k] for k in keys}, "activations": 0}}
        c.dry_runs = mine
        c.fits = memory_per_rank is None or c.device_bytes <= memory_per_rank
    return list(cands)

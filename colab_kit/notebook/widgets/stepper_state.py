"""What ``ScheduleStepper`` runs on the ranks, and the state it shows (no widgets here).

The rank functions run inside each engine through ``cluster.run`` and find the engine in
the rank's namespace by name (``engine`` unless told otherwise)::

    _rank_probe("engine")        -> (lowered plan, engine.pipeline.state())
    _rank_begin("engine", batch) -> state after engine.step.begin(batch)
    _rank_advance("engine", t)   -> engine.step.advance_to(t)
    _rank_finish("engine")       -> (loss, state, peak activation bytes)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...pipeline.plan import PipelinePlan

from ...pipeline.hang import render_grid
from colab_kit.notebook.cluster.remote import namespace

__all__ = ["StepperState", "StepperError"]


class StepperError(RuntimeError):
    """The stepper cannot drive the ranks (no cluster, no engine variable, an engine without pp)."""


# ------------------------------------------------------------------ run on the ranks
def _rank_engine(var: str):

    eng = namespace().get(var)
    if eng is None or getattr(eng, "pipeline", None) is None:
        return None
    return eng


def _rank_probe(var: str):
    """(plan, state) of this rank's pipeline, or a string saying what is missing."""
    eng = namespace().get(var)
    if eng is None:
        return f"no variable {var!r}"
    if getattr(eng, "pipeline", None) is None:
        return f"{var!r} is a {type(eng).__name__} without a pipeline (pp=1)"
    return eng.pipeline.plan, eng.pipeline.state()


def _rank_begin(var: str, batch):
    return _rank_engine(var).step.begin(batch)


def _rank_advance(var: str, timestep: int):
    return _rank_engine(var).step.advance_to(timestep)


def _rank_finish(var: str):
    eng = _rank_engine(var)
    loss = eng.step.finish()
    return loss, eng.step.state(), eng.memory()["activations"]


# ------------------------------------------------------------------ state
@dataclass
class StepperState:
    """What the stepper shows: the plan, how far the ranks got, what each reported."""

    plan: PipelinePlan
    """The lowered plan the ranks run."""
    grid: list
    """Its lockstep grid (``check.steps``): per timestep, the action of each pipeline rank or None."""
    source: str
    """"engine on N ranks" or "plan only (no engine ran these actions)"."""
    step: int = 0
    """Training steps begun so far."""
    timestep: int = 0
    running: bool = False
    ranks: dict = field(default_factory=dict)
    """Pipeline rank -> the ``engine.pipeline.state()`` of its first global rank."""
    held: dict = field(default_factory=dict)
    """Pipeline rank -> [(timestep, activations held)], sampled after each advance."""
    loss: float | None = None
    """The loss of the last finished step."""
    losses: list = field(default_factory=list)
    peak_bytes: list | None = None
    """Per pipeline rank, the peak activation bytes of the last finished step (engine.memory())."""
    finished: bool = False
    """The step shown ran to the end (and, on an engine, finished: optimizer step done)."""

    @property
    def n_timesteps(self) -> int:
        return len(self.grid)

    @property
    def executed(self) -> set[str]:
        return {a for s in self.ranks.values() for a in s.get("executed", [])}

    @property
    def current(self) -> dict[int, str | None]:
        return {r: s.get("next") for r, s in self.ranks.items()} if self.running else {}

    def walk(self, timestep: int) -> list[dict]:
        """Plan only: the states the ranks would report after every action before ``timestep``."""
        out = []
        for r, row in enumerate(self.plan.actions):
            n = sum(1 for t in range(min(timestep, self.n_timesteps)) if self.grid[t][r] is not None)
            ran = row[:n]
            live = [a for a in ran if a.kind == "F"]
            freed = {(a.stage, a.microbatch) for a in ran if a.kind in ("B", "W")}
            out.append({"rank": r, "pp_rank": r, "step": self.step, "running": True, "timestep": timestep,
                        "position": n, "of": len(row), "executed": [str(a) for a in ran],
                        "next": str(row[n]) if n < len(row) else None, "held_bytes": 0,
                        "held": [str(a) for a in live if (a.stage, a.microbatch) not in freed]})
        return out

    def __repr__(self) -> str:
        plan = self.plan
        where = ("finished" if self.finished else f"timestep {self.timestep} of {self.n_timesteps}" if self.running
                 else "not started")
        lines = [f"{plan.schedule} pp={plan.pp} microbatches={plan.microbatches}" +
                 (f" chunks={plan.chunks}" if plan.chunks > 1 else "") + f", {self.source}: step {self.step}, {where}"]
        if self.running:
            ts = [[t for t, row in enumerate(self.grid) if row[r] is not None] for r in range(plan.pp)]
            lines.append(render_grid(plan, ts, {r: s["position"] for r, s in self.ranks.items()}))
        for r, s in sorted(self.ranks.items()):
            held = s.get("held", [])
            what = f"next {s['next']}" if s.get("next") and self.running else "ran its whole plan"
            lines.append(f"pp rank {r} (rank {s.get('rank', r)}): ran {len(s.get('executed', []))} of "
                         f"{s.get('of', '?')} actions, {what}, "
                         f"holds {len(held)} activation{'s' if len(held) != 1 else ''}"
                         + (f" ({s['held_bytes'] / 1024:.1f} KiB)" if s.get("held_bytes") else ""))
        if self.loss is not None:
            lines.append(f"loss of step {len(self.losses)}: {self.loss:.4f}")
        return "\n".join(lines)

"""The planner's answer: ``Candidate`` (one config with its estimates) and ``Candidates`` (best first)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import ParallelConfig

__all__ = ["Candidate", "Candidates"]


@dataclass
class Candidate:
    """One configuration with its estimates (see the module docstring)."""

    config: ParallelConfig
    memory: dict
    step_seconds: float
    fits: bool
    breakdown: dict
    collectives: dict = field(default_factory=dict)
    boost_kwargs: dict = field(default_factory=dict)
    estimate: Any = None
    """On a hardware preset: the ``ck.estimate`` this candidate was ranked by (MFU, tokens/s, assumptions)."""
    dry_runs: list = field(default_factory=list)
    """``plan(..., exact=k)``: the ``DryRunReport`` of each pipeline stage's first rank; then ``memory`` is the
    fullest of them (model states plus estimated activations): its params, grads and optimizer exact to the
    byte, its activations the engine's estimate for that rank."""

    @property
    def exact(self) -> bool:
        return bool(self.dry_runs)

    @property
    def device_bytes(self) -> int:
        return sum(self.memory["device"].values())

    @property
    def why(self) -> str:
        """What dominates the cost, e.g. ``compute 71%, comm:tp 22% (8 per step)``."""
        total = self.step_seconds or 1.0
        top = sorted(self.breakdown.items(), key=lambda kv: -kv[1])[:2]
        words = []
        for k, v in top:
            n = self.collectives.get(k.split(":")[1]) if k.startswith("comm:") else None
            words.append(f"{k} {100 * v / total:.0f}%" + (f" ({n} per step)" if n else ""))
        return ", ".join(words)

    def describe(self) -> str:
        c = self.config
        extra = [f"ep={c.ep}"] * (c.ep > 1) + [f"zero={c.zero}"] * bool(c.zero)
        extra += [f"offload={c.offload}"] * (c.offload != "none")
        if c.pp > 1:
            extra.append(f"{c.schedule} m={c.microbatches}" + (f" v={c.chunks}" if c.chunks > 1 else ""))
        elif c.microbatches > 1:
            extra.append(f"m={c.microbatches}")
        if c.sp > 1 or c.sp_mode == "split_gather":
            extra.append(c.sp_mode)
        text = c.describe().split(" = ")[0].replace(", selective recompute", "").replace(", op recompute", "")
        text = text.replace(", recompute", "")
        return " ".join([text] + extra + {"full": ["recompute"], "selective": ["selective"],
                                          "op": ["op-recompute"]}.get(c.recompute, []))


class Candidates(list):
    """The candidates, best first; ``table()`` as text, ``_repr_html_()`` in a notebook."""

    constants: dict = {}
    memory_per_rank: int | None = None

    def __getitem__(self, i):
        got = super().__getitem__(i)
        if isinstance(i, slice):  # cands[:3] keeps table() and the constants
            got = Candidates(got)
            got.constants, got.memory_per_rank = self.constants, self.memory_per_rank
        return got

    def table(self, top: int | None = None) -> str:
        """The candidates as text: MiB and ms on this machine's scale, GiB, seconds and MFU on a preset's."""
        rows = self[:top] if top else self
        big = any(c.estimate is not None for c in rows)
        unit, scale, t_unit, t_scale = ("GiB", 2 ** 30, "s/step", 1.0) if big else ("MiB", 2 ** 20, "ms/step", 1e3)
        mfu = f" {'MFU':>5}" if big else ""
        w = 60 if big else 44  # at scale a config names more: every axis, the schedule, chunks, split_gather
        head = (f"{'#':>3}  {'config':{w}} {'fits':4} {unit + '/rank':>9} {'states':>9} {'acts':>9} {t_unit:>8}{mfu}"
                "  why")
        lines = [head]
        for i, c in enumerate(rows):
            states = c.memory["params"] + c.memory["grads"] + c.memory["optimizer"]
            mark = "*" if c.exact else " "
            extra = f" {100 * c.estimate.mfu:4.1f}%" if big and c.estimate is not None else ""
            lines.append(f"{i:>3}{mark} {c.describe()[:w]:{w}} {'yes' if c.fits else 'no':4} "
                         f"{c.device_bytes / scale:9.2f} {states / scale:9.2f} {c.memory['activations'] / scale:9.2f} "
                         f"{t_scale * c.step_seconds:8.{3 if big else 1}f}{extra}  {c.why}")
        budget = "no memory limit" if self.memory_per_rank is None else f"memory_per_rank {self.memory_per_rank:,} B"
        exact = " (* model states exact, from a dry run of the rank)" if any(c.exact for c in rows) else ""
        lines.append(f"{len(rows)} of {len(self)} candidates; {budget}; estimates ({unit} on the device per rank)"
                     f"{exact}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html
        rows = "".join(
            f"<tr style='{'' if c.fits else 'color:#999'}'><td>{i}</td><td>{html.escape(c.describe())}</td>"
            f"<td>{'yes' if c.fits else 'no'}</td><td>{c.device_bytes / 2**20:.2f}</td>"
            f"<td>{1e3 * c.step_seconds:.1f}</td><td>{html.escape(c.why)}</td></tr>" for i, c in enumerate(self))
        return ("<table><thead><tr><th>#</th><th>config</th><th>fits</th><th>MiB/rank (est.)</th>"
                f"<th>ms/step (est.)</th><th>why</th></tr></thead><tbody>{rows}</tbody></table>")

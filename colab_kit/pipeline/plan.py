"""``PipelinePlan``: one training step of a pipeline schedule as data, ``actions[r]`` for pipeline rank r.

The schedules (``schedules.build_plan``) write one, ``lowering.lower`` adds its messages, ``check`` proves
it free of deadlock, ``simulate`` times it, the executor runs it. It decides where each stage runs
(``rank_of``). Worked example, 1F1B with pp=2 and 2 microbatches::

    >>> from colab_kit.pipeline import build_plan
    >>> print(build_plan("1f1b", 2, 2))
    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1B0 1F1 1B1
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .actions import Action, format_actions, parse_one

__all__ = ["PipelinePlan", "PLACEMENTS", "SCHEDULE_PLACEMENT", "stage_rank"]

PLACEMENTS = ("loop", "v")
"""How stages are dealt to pipeline ranks (``PipelinePlan.rank_of``)."""
SCHEDULE_PLACEMENT = {"gpipe": "loop", "1f1b": "loop", "interleaved": "loop", "zb-h1": "loop", "zb-v": "v"}
"""The placement each generator writes its plan for."""


@dataclass
class PipelinePlan:
    """One training step of a pipeline schedule: ``actions[r]`` is what pipeline rank r runs, in order."""

    pp: int
    """Pipeline ranks (one list of actions each)."""
    microbatches: int
    """Microbatches per step."""
    chunks: int
    """Model chunks (virtual stages) per rank; stage s is chunk s // pp, on rank ``rank_of(s)``."""
    schedule: str
    """Name of the generator ('gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v') or 'custom'."""
    actions: list[list[Action]] = field(default_factory=list)
    """Per pipeline rank, the actions in execution order."""
    lowered: bool = False
    """True once ``lower`` added the send and receive actions."""
    placement: str = "loop"
    """How stages are dealt to ranks: 'loop' (round-robin) or 'v' (zig-zag); see ``rank_of``."""

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}: one of {', '.join(map(repr, PLACEMENTS))}")

    @property
    def n_stages(self) -> int:
        return self.pp * self.chunks

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``: the one place that decides it.

        Chunk ``c = stage // pp`` walks the ranks upwards under 'loop' placement; under 'v'
        the odd chunks walk back down, so stage pp-1 and stage pp share the last rank and the
        first and last stages share rank 0. With pp=3, chunks=2::

            stage   0 1 2 | 3 4 5
            'loop'  0 1 2 | 0 1 2
            'v'     0 1 2 | 2 1 0
        """
        chunk, i = divmod(stage, self.pp)
        return self.pp - 1 - i if self.placement == "v" and chunk % 2 else i

    def stages_of(self, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` runs, in chunk order (``[0, 5]`` for rank 0 above, under 'v')."""
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: {format_actions(a)}" for r, a in enumerate(self.actions))

    def __repr__(self) -> str:
        n = sum(len(a) for a in self.actions)
        where = f", placement={self.placement!r}" if self.placement != "loop" else ""
        return (f"PipelinePlan({self.schedule!r}, pp={self.pp}, microbatches={self.microbatches}, "
                f"chunks={self.chunks}{where}, lowered={self.lowered}, {n} actions)")

    def compute(self, rank: int) -> list[Action]:
        """The compute actions (F, B, I, W) of one rank, communication left out."""
        return [a for a in self.actions[rank] if not a.is_comm]

    @classmethod
    def parse(cls, text: str, schedule: str = "custom", *, pp: int | None = None,
              microbatches: int | None = None, chunks: int | None = None,
              lowered: bool | None = None, placement: str | None = None) -> PipelinePlan:
        """Read the printed form back: one line per rank, an optional ``rank r:`` prefix.

        Blank lines and ``#`` comments are skipped. ``pp`` is the number of lines, the
        other sizes are inferred from the largest stage and microbatch unless given,
        ``lowered`` from the presence of communication actions, and ``placement`` from
        the schedule's name, else as the first of 'loop', 'v' that puts every action on
        the rank that lists it::

            >>> PipelinePlan.parse("rank 0: 0F0 1F0 1B0 0B0").chunks   # pp=1, two stages on rank 0
            2
            >>> PipelinePlan.parse("rank 0: 0F0 3F0\\nrank 1: 1F0 2F0").placement   # stage 3 back on rank 0
            'v'
        """
        rows: list[list[Action]] = []
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.match(r"^rank\s+(\d+)\s*:(.*)$", line)
            if m:
                if int(m.group(1)) != len(rows):
                    raise ValueError(f"plan text lists rank {m.group(1)} where rank {len(rows)} was expected")
                line = m.group(2)
            words = line.split()
            rows.append([parse_one(w) for w in words])
        pp = pp or len(rows)
        rows += [[] for _ in range(pp - len(rows))]
        everything = [a for row in rows for a in row]
        n_stages = max((a.stage for a in everything), default=0) + 1
        chunks = chunks or max(1, -(-n_stages // pp))
        microbatches = microbatches or max((a.microbatch for a in everything), default=0) + 1
        lowered = any(a.is_comm for a in everything) if lowered is None else lowered
        if placement is None:
            placement = SCHEDULE_PLACEMENT.get(schedule) or next(
                (p for p in PLACEMENTS if all(cls(pp, 1, 1, schedule, placement=p).rank_of(a.stage) == r
                                              for r, row in enumerate(rows) for a in row)), "loop")
        return cls(pp, microbatches, chunks, schedule, rows, lowered, placement)


def stage_rank(stage: int, pp: int, placement: str = "loop") -> int:
    """The pipeline rank that runs ``stage``, for code without a plan at hand (``PipelinePlan.rank_of`` decides)."""
    return PipelinePlan(pp, 1, 1, "custom", placement=placement).rank_of(stage)

"""What the collectives record: ``CommRecord`` (one collective on one rank: payload and wire
bytes, seconds), ``CommLog`` (a mesh's records) and ``wire_bytes`` (the ring / chain model of
each op). Part of ``colab_kit.comm``; its docstring gives both byte counts with a worked example."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

__all__ = ["wire_bytes", "CommRecord", "CommLog"]


def wire_bytes(op: str, payload: int, n: int) -> int:
    """Bytes one rank sends for a collective of ``payload`` bytes (see the module docstring)."""
    if op in ("send",):
        return payload
    if op == "recv" or n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * payload // n
    if op == "all_gather":
        return (n - 1) * payload
    return (n - 1) * payload // n  # reduce_scatter, broadcast, reduce, all_to_all


@dataclass
class CommRecord:
    op: str
    axis: str
    bytes: int          # payload: what this rank handed to the collective (the papers' unit)
    seconds: float
    tag: str = ""
    wire: int = 0       # bytes this rank sent under the ring / chain model (``wire_bytes``)
    # when it happened (perf_counter), for profiles: ``end`` when it completed and was recorded (it was
    # launched ``seconds`` before), ``waited`` when this rank's thread began waiting for it (``wait()`` of an
    # async collective or message; None for a blocking call). Not compared, not shown.
    end: float = field(default=0.0, compare=False, repr=False)
    waited: float | None = field(default=None, compare=False, repr=False)


@dataclass
class CommLog:
    """Per-rank list of collectives; ``step()`` marks where a training step begins."""

    records: list = field(default_factory=list)
    step_start: int = 0

    def add(self, op: str, axis: str, nbytes: int, seconds: float, tag: str = "", n: int = 1,
            end: float | None = None, wire: int | None = None) -> CommRecord:
        """Record one call; ``n`` is the group's size (for the wire bytes). ``end``: the clock reading
        (``time.perf_counter()``) that ``seconds`` was measured to, so that ``end - seconds`` is when the call
        began even when this process is descheduled before it records; now if not given. ``wire``: the bytes
        this rank sent, where the op's model does not give them (an uneven all-to-all)."""
        rec = CommRecord(op, axis, int(nbytes), float(seconds), tag,
                         wire_bytes(op, int(nbytes), n) if wire is None else int(wire),
                         end=time.perf_counter() if end is None else end)
        self.records.append(rec)
        return rec

    def begin_step(self) -> None:
        self.step_start = len(self.records)

    def last_step(self) -> list[CommRecord]:
        return self.records[self.step_start:]

    def summary(self, records=None) -> dict:
        """Totals by (op, axis): count, bytes (payload), wire, seconds."""
        out: dict = {}
        for r in self.records if records is None else records:
            s = out.setdefault(f"{r.op}@{r.axis}", {"count": 0, "bytes": 0, "wire": 0, "seconds": 0.0})
            s["count"] += 1
            s["bytes"] += r.bytes
            s["wire"] += r.wire
            s["seconds"] += r.seconds
        return out

    def as_dicts(self, records=None) -> list[dict]:
        """Each record as a dict of what it says (op, axis, bytes, seconds, tag, wire), without the timestamps:
        they are this process's clock."""
        return [{k: v for k, v in asdict(r).items() if k not in ("end", "waited")}
                for r in (self.records if records is None else records)]

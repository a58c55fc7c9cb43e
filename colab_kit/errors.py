"""Errors that cross process boundaries: which rank failed, where, and why."""
from __future__ import annotations

__all__ = ["RankError", "RankTimeout"]


class RankError(RuntimeError):
    """One or more ranks raised. ``failures`` maps rank -> remote traceback text;
    ``stuck`` lists ranks that were still running (typically waiting in a collective
    for a failed peer) when the caller gave up on them."""

    def __init__(self, failures: dict[int, str], stuck: list[int] | None = None, where: str = "",
                 advice: str = ""):
        self.failures = dict(failures)  # in the order the failures arrived: the first is the cause
        self.stuck = sorted(stuck or [])
        self.where = where
        self.advice = advice
        super().__init__(self._message())

    @property
    def rank(self) -> int:
        """The first failing rank (for a timeout, where none failed: the first stuck rank)."""
        return next(iter(self.failures), self.stuck[0] if self.stuck else None)

    def _message(self) -> str:
        first, *later = self.failures
        lines = [f"rank {first} failed" + (f" in {self.where}" if self.where else "")
                 + f": {_last_line(self.failures[first])}"]
        for rank in later:
            lines.append(f"  rank {rank} failed after it: {_last_line(self.failures[rank])}")
        if self.stuck:
            lines.append(f"  ranks {', '.join(map(str, self.stuck))} were still waiting (most likely in a "
                         "collective for the failed rank)")
        if self.advice:
            lines.append(self.advice)
        first = next(iter(self.failures.items()), None)
        if first and first[1].strip():
            lines.append(f"--- traceback of rank {first[0]} ---\n{first[1].rstrip()}")
        return "\n".join(lines)


def _last_line(tb: str) -> str:
    return tb.strip().splitlines()[-1] if tb.strip() else "(no traceback)"


class RankTimeout(RankError):
    """No rank failed, but some did not finish within the timeout."""

    def __init__(self, stuck: list[int], timeout: float, where: str = "", advice: str = ""):
        self.timeout = timeout
        super().__init__({}, stuck, where, advice)

    def _message(self) -> str:
        ranks = ", ".join(map(str, self.stuck))
        return (f"ranks {ranks} did not finish within {self.timeout:g} s" + (f" in {self.where}" if self.where else "")
                + " (a collective that not every rank entered waits forever)" + (f"\n{self.advice}" if self.advice else ""))

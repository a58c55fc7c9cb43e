"""Errors that cross process boundaries: which rank failed, where, and why.

IPython shows them through ``_render_traceback_`` (its protocol for exceptions that
know how to show themselves): the message, not the kernel-side traceback, which
only leads into colab_kit. For a rank that raised ``ValueError('bad')`` in a cell::

    RankError: rank 1 failed in %%colossal: ValueError: bad
      ranks 0 were still waiting (most likely in a collective for the failed rank)
    --- traceback of rank 1 ---
    ...the rank's own traceback...

They pickle with every field (``failures``, ``stuck``, ``where``, ``advice``, ``timeout``).
"""
from __future__ import annotations

__all__ = ["MessageOnly", "RankError", "RankTimeout"]


class MessageOnly:
    """Mixin: IPython shows ``Name: message`` and no kernel-side traceback."""

    def _render_traceback_(self) -> list[str]:
        return f"{type(self).__name__}: {self}".splitlines()


class RankError(MessageOnly, RuntimeError):
    """One or more ranks raised. ``failures`` maps rank -> remote traceback text;
    ``stuck`` lists ranks that were still running (typically waiting in a collective
    for a failed peer) when the caller gave up on them.

    ``shown = True`` says every rank's traceback was printed already (the magic does
    that): IPython then shows only the summary, not the first traceback again."""

    outputs: dict
    """Every rank's ``RankOutput`` where ``Cluster.execute`` raised it (absent elsewhere)."""
    shown: bool
    """Set by the magic once it printed every rank's traceback (absent before)."""

    def __init__(self, failures: dict[int, str], stuck: list[int] | None = None, where: str = "",
                 advice: str = ""):
        self.failures = dict(failures)  # in the order the failures arrived: the first is the cause
        self.stuck = sorted(stuck or [])
        self.where = where
        self.advice = advice
        super().__init__(self._message())

    def __reduce__(self):
        # Exception pickles as cls(*self.args), and args is the message: rebuild from the fields instead
        return type(self), self._init_args(), self.__dict__

    def _init_args(self) -> tuple:
        return self.failures, self.stuck, self.where, self.advice

    @property
    def rank(self) -> int | None:
        """The first failing rank (for a timeout, where none failed: the first stuck rank; None without either)."""
        return next(iter(self.failures), self.stuck[0] if self.stuck else None)

    def summary(self) -> str:
        """The message without the first failing rank's traceback."""
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
        return "\n".join(lines)

    def _message(self) -> str:
        rank, tb = next(iter(self.failures.items()))
        return self.summary() + (f"\n--- traceback of rank {rank} ---\n{tb.rstrip()}" if tb.strip() else "")

    def _render_traceback_(self) -> list[str]:
        text = self.summary() if getattr(self, "shown", False) else str(self)
        return f"{type(self).__name__}: {text}".splitlines()


def _last_line(tb: str) -> str:
    return tb.strip().splitlines()[-1] if tb.strip() else "(no traceback)"


class RankTimeout(RankError):
    """No rank failed, but some did not finish within the timeout."""

    def __init__(self, stuck: list[int], timeout: float, where: str = "", advice: str = ""):
        self.timeout = timeout
        super().__init__({}, stuck, where, advice)

    def _init_args(self) -> tuple:
        return self.stuck, self.timeout, self.where, self.advice

    def summary(self) -> str:
        ranks = ", ".join(map(str, self.stuck))
        return (f"ranks {ranks} did not finish within {self.timeout:g} s" + (f" in {self.where}" if self.where else "")
                + " (a collective that not every rank entered waits forever)"
                + (f"\n{self.advice}" if self.advice else ""))

    def _message(self) -> str:
        return self.summary()

"""What comes back from the ranks of a ``Cluster``: per-rank outputs, the ranks table,
and the unwrapping of ipyparallel results into (ok, value) pairs.

For ``cluster.execute("print(rank); rank * 2")`` on 2 ranks::

    {0: RankOutput(rank=0, stdout="0\\n", result="0", status="ok"),
     1: RankOutput(rank=1, stdout="1\\n", result="2", status="ok")}

A rank that raised has ``status="error"`` and ``error`` = its plain-text traceback;
a rank still running when the caller gave up has ``status="stuck"`` and whatever
it had printed so far.
"""
from __future__ import annotations

import re
from typing import cast
from dataclasses import dataclass, field

from ...errors import RankError
from ...errors.stacks import without_dumps

__all__ = ["RankOutput", "RankTable", "split", "check_ranks", "unwrap_plain", "unwrap_call", "unwrap_execute",
           "rank_output"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class RankOutput:
    """What one rank printed and returned for a code string (``Cluster.execute``)."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    result: str | None = None           # text/plain of the cell's last expression
    error: str | None = None            # plain-text traceback when the rank raised
    status: str = "ok"                  # "ok", "error", "interrupted" (Ctrl-C) or "stuck" (still running
                                        # when given up on)
    displays: list = field(default_factory=list)  # rich outputs: {"data": ..., "metadata": ...}


class RankTable(list):
    """The ranks table: a list of row dicts that prints as an aligned table."""

    def __str__(self) -> str:
        if not self:
            return "(no ranks)"
        cols = list(self[0])
        width = {c: max(len(c), *(len(str(r[c])) for r in self)) for c in cols}
        lines = ["  ".join(c.ljust(width[c]) for c in cols)]
        lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in self]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        if not self:
            return "<i>no ranks</i>"
        head = "".join(f"<th>{c}</th>" for c in self[0])
        body = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in r.values()) + "</tr>" for r in self)
        return f"<table><tr>{head}</tr>{body}</table>"


def _remote_error_text(exc: BaseException) -> str:
    if "EngineError" in (type(exc).__name__, getattr(exc, "ename", None)):  # the process is gone
        return f"EngineError: this rank's engine process died while running the call: {exc}"
    tb = getattr(exc, "traceback", None)
    if isinstance(tb, list):
        tb = "\n".join(tb)
    text = tb or f"{type(exc).__name__}: {exc}"
    return _ANSI.sub("", text)


def unwrap_plain(ar) -> tuple[bool, object]:
    try:
        return True, ar.get()
    except Exception as exc:  # noqa: BLE001 - a RemoteError/EngineError is a failure of that rank
        return False, _remote_error_text(exc)


def unwrap_call(ar) -> tuple[bool, object]:
    ok, value = unwrap_plain(ar)
    if not ok:
        return False, value
    status, result = cast(tuple, value)  # remote.call's ("ok" or "error", value)
    return status == "ok", result


def unwrap_execute(ar) -> tuple[bool, object]:
    ok, value = unwrap_plain(ar)
    return ok, (None if ok else value)


def rank_output(rank: int, ar, err: RankError | None, interrupted: bool = False) -> RankOutput:
    if ar.ready():
        ar.wait_for_output(1.0)  # stdout arrives on its own channel, a little after the result
    status = "stuck" if not ar.ready() else "error" if err is not None and rank in err.failures else "ok"
    if interrupted and status == "ok" and not unwrap_plain(ar)[0]:
        status = "interrupted"
    stderr = without_dumps(ar.stderr or "")  # less the stacks it wrote when asked where it was (gather._where)
    if status == "interrupted":
        return RankOutput(rank, ar.stdout or "", stderr, None, None, status, [])
    res = ar.execute_result if status == "ok" else None
    displays = [{"data": o.get("data", {}), "metadata": o.get("metadata", {})}
                for o in (ar.outputs or []) if isinstance(o, dict)]
    return RankOutput(rank, ar.stdout or "", stderr,
                      res["data"].get("text/plain") if res else None,
                      err.failures.get(rank) if status == "error" and err is not None else None, status, displays)


def split(ar, ranks: list[int]) -> dict:
    """One AsyncResult per rank out of a multi-engine one: ipyparallel's public
    ``AsyncResult.split()`` gives one per message, in target order; ``check_ranks``
    confirms that order from each finished result's metadata (the engine that ran it)."""
    return dict(zip(ranks, ar.split()))


def _engine_of(ar) -> int | None:
    """The engine that ran a finished result: the key of ``get_dict()`` where it succeeded (``ar.metadata``
    first parses the result's four timestamps with dateutil, on every call, for every rank), else
    ``metadata["engine_id"]``; None while it runs."""
    if not ar.ready():
        return None
    if ar.successful():
        return next(iter(ar.get_dict(0)))
    return ar.metadata.get("engine_id")


def check_ranks(ars: dict, engine_ids: list[int]) -> None:
    """Every finished result came from the engine of its rank (``_engine_of``)."""
    for rank, ar in ars.items():
        got = _engine_of(ar)
        if got is not None and got != engine_ids[rank]:
            raise RuntimeError(f"the result for rank {rank} came from engine {got}, not from its engine "
                               f"{engine_ids[rank]}: ipyparallel's message order changed; please report this")

"""``CellWatcher``: a view that refreshes itself after each ``%%colossal`` cell (or every cell).

A mixin for views with ``refresh()``, a ``cluster`` property (raising a ``LookupError`` when there is none),
``busy``, ``_report(exc)`` and ``_redraw()``::

    view = ck.widgets.MoEView().watch()   # refreshed after each successful %%colossal cell
    view.watch(every_cell=True)           # after every successful cell (a cluster.run(train), say)
    view.unwatch()

``watch()`` registers a ``post_run_cell`` callback with the IPython shell. A failed cell, a cluster that
needs a restart or is not running is skipped; a refresh that fails shows its error in the widget (``_report``),
never in the cell. ``MemoryView`` and ``MoEView`` use it.

``RankView`` adds what both views share besides: the cluster they read (``find_cluster``), the Refresh
button's work (``click_refresh``: ``_gather`` in a worker thread while the kernel's loop runs, then ``_take``),
the busy state and the error area (``_busy``, ``_report``). A view defines ``_gather()`` (read the ranks),
``_take(got)`` (keep it and redraw) and a ``_ui`` dict with a ``"refresh"`` button and an ``"errors"`` output.
"""
from __future__ import annotations

from typing import Any, TypeVar

from .display import then
from ..session import find

__all__ = ["CellWatcher", "RankView", "find_cluster"]


def find_cluster(source, missing: type[LookupError], view: str):
    """The running cluster of ``source`` (a ``Cluster``, a ``ColossalState``, or None: the ``%colossal``
    state's), looked up now; ``missing`` (the view's error) saying how to start one otherwise."""
    source = source if source is not None else find()
    if hasattr(source, "require_cluster"):
        source = source.cluster
    if source is None or not getattr(source, "running", False):
        raise missing(f"no cluster to read: start one with %colossal start -n 4, or pass {view}(cluster)")
    return source


class CellWatcher:
    """Watching after cells (module docstring); call ``_init_watch()`` in ``__init__``."""

    busy: bool

    def _init_watch(self) -> None:
        self._shell: Any = None
        self._every_cell = False

    def watch(self, shell=None, every_cell: bool = False):
        from IPython import get_ipython

        self.unwatch()
        self._shell, self._every_cell = shell or get_ipython(), every_cell
        if self._shell is None:
            raise RuntimeError("watch() needs IPython (a notebook or an IPython shell): call refresh() instead")
        self._shell.events.register("post_run_cell", self._after_cell)
        self._redraw()
        return self

    def unwatch(self) -> None:
        if self._shell is not None:
            try:
                self._shell.events.unregister("post_run_cell", self._after_cell)
            except ValueError:
                pass
            self._shell = None
            self._redraw()

    @property
    def watching(self) -> bool:
        return self._shell is not None

    def _after_cell(self, result) -> None:
        info = getattr(result, "info", None)
        cell = (getattr(info, "raw_cell", None) or "").lstrip()
        if not result.success or not (self._every_cell or cell.startswith("%%colossal")) or self.busy:
            return
        try:
            cluster = self.cluster  # type: ignore[attr-defined]
        except LookupError:  # no cluster running now: nothing to read
            return
        if getattr(cluster, "needs_restart", False):
            return
        try:
            self.refresh()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - a callback must not break the cell it follows
            self._report(exc)  # type: ignore[attr-defined]

    def _redraw(self) -> None:  # each view draws itself
        raise NotImplementedError


_View = TypeVar("_View", bound="RankView")


class RankView(CellWatcher):
    """A view of what every rank recorded, read again by ``refresh()`` or its Refresh button (module docstring).
    A view sets ``missing`` (its LookupError) and ``_source`` (what ``find_cluster`` reads)."""

    missing: type[LookupError] = LookupError
    _source: Any
    _ui: dict[str, Any] | None
    error: str | None
    _task: Any = None

    @property
    def cluster(self):
        """The running cluster this view reads, looked up now (``find_cluster``)."""
        return find_cluster(self._source, self.missing, type(self).__name__)

    def refresh(self: _View) -> _View:
        """Read every rank again (``_gather``), then keep it and redraw (``_take``); returns the view."""
        self._take(self._gather())  # type: ignore[attr-defined]
        return self

    def click_refresh(self):
        """The Refresh button: under a running event loop a task (returned) that reads the ranks in a worker
        thread, so the kernel stays free; else a refresh now (returns None). Errors go to the widget."""
        if self.busy:
            return self._task
        self._busy(True)

        def attempt():
            try:
                return self._gather(), None  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - a button has nowhere else to report
                return None, exc

        def done(result) -> None:
            got, exc = result
            self._busy(False)
            if exc is not None:
                self._report(exc)
            else:
                self._take(got)  # type: ignore[attr-defined]

        self._task = then(attempt, done)
        return self._task

    def _busy(self, busy: bool) -> None:
        self.busy = busy
        if self._ui is not None:
            self._ui["refresh"].disabled = busy
            if busy:
                self._ui["errors"].outputs = ()

    def _report(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        if self._ui is not None:
            self._ui["errors"].append_stderr(self.error + "\n")
            self._redraw()

"""``CellWatcher``: a view that refreshes itself after each ``%%colossal`` cell (or every cell).

A mixin for views with ``refresh()``, a ``cluster`` property (raising a ``LookupError`` when there is none),
``busy``, ``_report(exc)`` and ``_redraw()``::

    view = ck.widgets.MoEView().watch()   # refreshed after each successful %%colossal cell
    view.watch(every_cell=True)           # after every successful cell (a cluster.run(train), say)
    view.unwatch()

``watch()`` registers a ``post_run_cell`` callback with the IPython shell. A failed cell, a cluster that
needs a restart or is not running is skipped; a refresh that fails shows its error in the widget (``_report``),
never in the cell. ``MemoryView`` and ``MoEView`` use it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["CellWatcher"]


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

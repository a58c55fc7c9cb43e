"""How every widget shows itself, and how its buttons keep the kernel free.

A widget object (``ConfigPicker``, ``ScheduleStepper``) is displayed as one bundle: the
ipywidgets view for a frontend that renders widgets, and ``repr(obj)`` as ``text/plain``
for one that cannot (``jupyter nbconvert --to markdown``, ``jupyter console``, a notebook
viewer). Outside a kernel the text form is printed::

    picker = ck.widgets.ConfigPicker(world_size=4)
    picker._repr_mimebundle_()
    # in a kernel: {"text/plain": "ConfigPicker(dp=4 ...)\\nok: dp=4 = 4 ranks ...\\nmesh: dp groups [0, 1, 2, 3]",
    #               "application/vnd.jupyter.widget-view+json": {"model_id": ..., ...}}
    # elsewhere:   {"text/plain": ...} only

A button whose work calls the cluster hands that call to a worker thread that a task on
the kernel's event loop awaits (``off_loop``), so the kernel keeps handling messages (a
Pause click, other widgets, output) meanwhile. ``running_loop()`` is None in plain Python:
the buttons then do their work at once, synchronously.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["KernelDisplay", "running_loop", "off_loop", "in_kernel", "html"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where a widget can be rendered), False in plain Python or a terminal."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running this code (the kernel's, in a widget callback), or None in plain Python."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def off_loop(fn, *args):
    """``fn(*args)`` in a worker thread, awaited: the loop (the kernel) stays free while it blocks."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def keep_quiet(task: asyncio.Task) -> asyncio.Task:
    """Mark a button's task as looked at: its error is already shown in the widget, not logged again."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def then(attempt, done):
    """A button's work: ``done(attempt())``, with ``attempt`` in a worker thread when the kernel's
    loop runs (so the kernel stays free while the ranks work) and at once in plain Python.
    Returns the task, or None when it ran at once."""
    loop = running_loop()
    if loop is None:
        done(attempt())
        return None

    async def work():
        done(await off_loop(attempt))

    return keep_quiet(loop.create_task(work()))


class KernelDisplay:
    """Shows ``self.widget()`` in a kernel with ``repr(self)`` as its text/plain; elsewhere prints ``repr``."""

    widget: Callable[[], Any]  # each subclass builds its own ipywidgets view

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        bundle = {"text/plain": repr(self)}
        if in_kernel():
            try:
                view = self.widget()
            except ImportError:  # no ipywidgets: the text form is all there is
                return bundle
            bundle.update({k: v for k, v in view._repr_mimebundle_().items() if k != "text/plain"})
        return bundle

    def _ipython_display_(self) -> None:
        if not in_kernel():
            print(repr(self))
            return
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)


def html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

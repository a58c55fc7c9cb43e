"""One place that puts a plotly figure into a widget and redraws it.

``figure_view(fig)`` is a ``go.FigureWidget`` where anywidget is installed, else an
``ipywidgets.Output``; ``redraw(view, fig)`` replaces what either shows.

Why the FigureWidget opens its comm late. plotly 7's ``FigureWidget.__init__`` opens the
widget's comm first (its state then holds ``_widget_data = []`` and ``_widget_layout = {}``)
and sets the figure's traces and layout afterwards, as two ``update`` messages sent a
millisecond later. A browser busy elsewhere (eight ranks training on two cores) is still
building the widget's model when those two messages arrive, and loses them: the model
keeps its empty opening state, every view of it draws the axes and no trace, and no later
message repairs it (plotly's view only redraws on trace edits). Seen with notebook 06's
PlannerView in headless Chromium (JupyterLab, Playwright, ``Emulation.setCPUThrottlingRate``
10, cells 1, 3, 7, 8, 10 and a second ``display(view)``), in one of two runs: the model's
``_widget_data`` stayed ``[]`` and both displays drew 0 points; it depends on timing.
``figure_view`` builds the widget with its comm closed and opens it once the figure is
set, so the opening message itself carries the traces and the layout::

    view = figure_view(go.Figure(go.Scatter(x=[1, 2], y=[3, 4])))
    # comm_open state: {"_widget_data": [{"type": "scatter", "x": [1, 2], "y": [3, 4], ...}],
    #                   "_widget_layout": {...}, ...}: nothing left for a later message to carry

``redraw`` sends nothing when the figure did not change (a widget redrawn right after it
was built would otherwise send its whole figure again, in the same fragile moment).
"""
from __future__ import annotations

__all__ = ["figure_view", "redraw"]

_FIGURE_CLASS = None


def _figure_class():
    """``go.FigureWidget`` whose comm opens after its figure is set (made once, on first use)."""
    global _FIGURE_CLASS
    if _FIGURE_CLASS is None:
        import plotly.graph_objects as go

        class FigureView(go.FigureWidget):
            """A FigureWidget whose comm_open carries its traces and layout (see the module docstring)."""

            def __init__(self, *args, **kwargs):
                object.__setattr__(self, "_view_opening", False)
                super().__init__(*args, **kwargs)
                object.__setattr__(self, "_view_opening", True)
                self.open()

            def open(self):
                if getattr(self, "_view_opening", True):  # not while plotly's __init__ runs
                    super().open()

        _FIGURE_CLASS = FigureView
    return _FIGURE_CLASS


def figure_view(fig):
    import ipywidgets as w

    try:
        return _figure_class()(fig)  # needs anywidget
    except Exception:  # noqa: BLE001 - fall back to displaying a plain figure in an Output
        view = w.Output()
        redraw(view, fig)
        return view


def _drawn(fig) -> tuple:
    """What a figure draws, as JSON: its traces (less the uids a FigureWidget adds) and its layout."""
    import json

    import plotly.io as pio

    spec = json.loads(pio.to_json(fig, validate=False))
    return [{k: v for k, v in t.items() if k != "uid"} for t in spec.get("data", [])], spec.get("layout", {})


def redraw(view, fig) -> None:
    if hasattr(view, "batch_update"):
        if _drawn(view) == _drawn(fig):
            return
        with view.batch_update():
            view.data = []
            view.add_traces(list(fig.data))
            view.layout = fig.layout
    else:
        from IPython.display import display

        view.clear_output(wait=True)
        with view:
            display(fig)

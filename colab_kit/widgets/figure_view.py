"""One place that puts a plotly figure into a widget and redraws it.

``figure_view(fig)`` is a ``go.FigureWidget`` where anywidget is installed, else an
``ipywidgets.Output``; ``redraw(view, fig)`` replaces what either shows.
"""
from __future__ import annotations

__all__ = ["figure_view", "redraw"]


def figure_view(fig):
    import ipywidgets as w
    import plotly.graph_objects as go

    try:
        return go.FigureWidget(fig)  # needs anywidget
    except Exception:  # noqa: BLE001 - fall back to displaying a plain figure in an Output
        view = w.Output()
        redraw(view, fig)
        return view


def redraw(view, fig) -> None:
    if hasattr(view, "batch_update"):
        with view.batch_update():
            view.data = []
            view.add_traces(list(fig.data))
            view.layout = fig.layout
    else:
        from IPython.display import display

        view.clear_output(wait=True)
        with view:
            display(fig)

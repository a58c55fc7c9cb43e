"""Notebook widgets, composed from the pure figure builders in ``colab_kit.viz``.

ipywidgets is imported only when a widget is displayed; outside a kernel each
widget prints its text form instead, and a frontend that cannot render widgets
(nbconvert to text, a console) shows that same text (``display.KernelDisplay``).
Buttons that call the cluster never block the kernel (see ``display``).

    ck.widgets.ConfigPicker()       # pick degrees and modes, see the mesh, Apply to the cluster
    ck.widgets.ScheduleStepper(cluster, batch)   # step a real pipeline step, watch the grid fill in
    ck.widgets.MemoryView().watch() # memory per rank, measured beside the estimate, after each step
    ck.widgets.PlannerView(ck.plan(model_cfg, 8, 16))  # the planner's candidates: table, scatter, Apply
    ck.widgets.MoEView().watch()    # expert load per step and the all-to-all traffic, after each step
"""
from .config_picker import ConfigPicker
from .memory_view import MemoryView
from .moe_view import MoEView
from .planner_view import PlannerView
from .schedule_stepper import ScheduleStepper

__all__ = ["ConfigPicker", "ScheduleStepper", "MemoryView", "PlannerView", "MoEView"]

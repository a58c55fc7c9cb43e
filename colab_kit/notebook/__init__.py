"""The notebook layer: what a user drives from a Jupyter kernel.

    cluster/     ck.Cluster: ipyparallel engines, one rank each, torch.distributed up
    magics/      %colossal and %%colossal, bound to one session
    widgets/     ConfigPicker, ScheduleStepper, MemoryView, PlannerView (figures from colab_kit.viz)
    session.py   ColossalState, the one session the magics and widgets act on, and current()
    progress.py  live progress lines for starting engines and long cells

Imports run one way: session and progress know nothing of the magics or widgets; the cluster knows
only progress; the widgets find the session through ``session.current()``, never the magics.
"""

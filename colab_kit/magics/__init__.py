"""``%colossal`` and ``%%colossal``: drive a ``ck.Cluster`` from a notebook (see ``core``).

    core.py            the magics (ColossalMagics), bound to one explicit ColossalState
    state.py           ColossalState: the cluster and the kernel-side config
    flags.py           every flag and subcommand, declared once; parsers; help text
    output.py          rank outputs grouped per rank; live progress lines (cells, start, restart)
    pipeline_views.py  what %colossal schedule / timeline show (plain functions)
"""
from .core import ColossalMagics, load_ipython_extension, state, unload_ipython_extension
from .output import show_outputs
from .state import ColossalState

__all__ = ["ColossalState", "ColossalMagics", "state", "show_outputs", "load_ipython_extension",
           "unload_ipython_extension"]

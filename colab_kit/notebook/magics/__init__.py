"""``%colossal`` and ``%%colossal``: drive a ``ck.Cluster`` from a notebook (see ``core``). The session they act
on (``ColossalState``) is ``colab_kit.notebook.session``; the live lines, ``colab_kit.notebook.progress``.

    core.py            the magics (ColossalMagics), bound to one explicit ColossalState
    flags.py           every flag and subcommand, declared once; parsers; help text
    output.py          rank outputs grouped per rank
    pipeline_views.py  what %colossal schedule / timeline show (plain functions)
"""
from .core import ColossalMagics, load_ipython_extension, state, unload_ipython_extension
from .output import show_outputs
from ..session import ColossalState

__all__ = ["ColossalState", "ColossalMagics", "state", "show_outputs", "load_ipython_extension",
           "unload_ipython_extension"]

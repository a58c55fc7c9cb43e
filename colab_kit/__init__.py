"""colab_kit: Colossal-AI style hybrid parallel training, from a notebook.

    import colab_kit as ck
    cfg = ck.ParallelConfig(dp=4)
    ck.MeshLayout(cfg).groups("dp")          # [[0, 1, 2, 3]]
    ck.launch(train_fn, cfg.world_size)      # local ranks, torch.distributed initialised
    with ck.Cluster(n=4) as cluster: ...     # ipyparallel engines, one per rank

In IPython / Jupyter: ``%load_ext colab_kit`` gives the ``%colossal`` magics.
"""
from __future__ import annotations

import importlib

from .config import ConfigError, ParallelConfig
from .dry_run import dry_run  # eager: the module has the function's name, which a lazy attribute would lose
from .errors import RankError, RankTimeout
from .launch import launch
from .mesh import MeshLayout, ProcessMesh

__version__ = "0.1.0"

__all__ = ["ParallelConfig", "ConfigError", "MeshLayout", "ProcessMesh", "launch", "init", "export", "Cluster", "boost",
           "Engine", "RankError", "RankTimeout", "models", "datasets", "recipe", "viz", "widgets", "comm", "tensor", "pipeline",
           "reference", "plan", "planner", "dry_run"]

_LAZY = {"Cluster": ("cluster", "Cluster"), "boost": ("engine", "boost"), "Engine": ("engine", "Engine"),
         "init": ("join", "init"), "export": ("magics.export", "export"),
         "plan": ("planner", "plan")}
_SUBMODULES = {"models", "datasets", "recipe", "optimizer", "viz", "widgets", "comm", "magics", "cluster", "engine", "data", "memory",
               "tensor", "pipeline", "reference", "planner", "checkpoint"}


def __getattr__(name):
    # heavy or optional parts (ipyparallel, plotly, ipywidgets) load on first use
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'colab_kit' has no attribute {name!r}")


def __dir__():
    # what is loaded on first use, too: tab completion and dir(ck) show the whole API
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


def load_ipython_extension(ipython):
    """``%load_ext colab_kit``: register the ``%colossal`` line and cell magics."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)

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

from .config import Axis, ConfigError, ParallelConfig
from .errors import RankError, RankTimeout
from .launch import launch
from .mesh import MeshLayout, ProcessMesh

__version__ = "0.2.0"

__all__ = ["ParallelConfig", "ConfigError", "Axis", "MeshLayout", "ProcessMesh", "launch", "init", "export", "Cluster",
           "boost", "Engine", "RankError", "RankTimeout", "models", "datasets", "recipe", "viz", "widgets", "comm",
           "tensor", "pipeline", "reference", "plan", "estimate", "planner", "dry_run", "parallelize", "throughput",
           "roofline", "profile", "memory_timeline", "placements", "state_vector", "dense_state_dict",
           "save_pretrained", "load_pretrained"]

# heavy or optional parts (ipyparallel, plotly, ipywidgets) load on first use: name -> (module, attribute)
_LAZY = {"Cluster": ("notebook.cluster", "Cluster"), "boost": ("engine.core", "boost"),
         "Engine": ("engine.core", "Engine"), "init": ("join", "init"), "export": ("notebook.magics.export", "export"),
         "plan": ("planner", "plan"), "dry_run": ("planner.dry_runs.run", "dry_run"),
         "estimate": ("planner.estimate", "estimate"),
         "parallelize": ("engine.parallelize", "parallelize"),
         # reports over an engine (each a function of it, not a method: colab_kit.engine.reports)
         "throughput": ("observe.throughput", "engine_throughput"), "roofline": ("observe.roofline", "roofline"),
         "profile": ("observe.profile", "profile"), "memory_timeline": ("memory.timeline", "memory_timeline"),
         "placements": ("engine.reports", "placements"), "state_vector": ("engine.reports", "state_vector"),
         "dense_state_dict": ("checkpoint.pretrained", "dense_state_dict"),
         "save_pretrained": ("checkpoint.pretrained", "save_pretrained"),
         "load_pretrained": ("checkpoint.pretrained", "load_pretrained")}
# ck.<name> -> the module it names (the notebook layer's three live in colab_kit.notebook)
_SUBMODULES = {"models": "models", "datasets": "datasets", "recipe": "models.recipe", "optimizer": "zero.optimizer",
               "viz": "viz", "widgets": "notebook.widgets", "comm": "comm", "magics": "notebook.magics",
               "cluster": "notebook.cluster", "engine": "engine", "data": "zero.stage0", "memory": "memory",
               "tensor": "tensor", "pipeline": "pipeline", "reference": "engine.reference", "planner": "planner",
               "checkpoint": "checkpoint", "notebook": "notebook", "observe": "observe", "zero": "zero",
               "sequence": "sequence", "policy": "policy"}


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    raise AttributeError(f"module 'colab_kit' has no attribute {name!r}")


def __dir__():
    # what is loaded on first use, too: tab completion and dir(ck) show the whole API
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def load_ipython_extension(ipython):
    """``%load_ext colab_kit``: register the ``%colossal`` line and cell magics, and start the kernel's engine
    fork server (its imports run beside the magics' own and the next cells: ``forked.prestart``)."""
    from .notebook.cluster.forked import prestart

    prestart()
    from .notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from .notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)

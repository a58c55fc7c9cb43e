"""Old module paths of the 0.1 layout, kept for one version: ``import colab_kit.engine_records`` still
works, warns once that the module moved, and gives the very module object of its new home (one class
``Cluster``, not two copies).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     import colab_kit.engine_records as old
    >>> import colab_kit.engine.records as new
    >>> old is new, "colab_kit.engine.records" in str(w[0].message)
    (True, True)

A submodule of a moved package moves with it: ``colab_kit.cluster.remote`` is
``colab_kit.notebook.cluster.remote``. ``colab_kit.dry_run`` was a module named like the function
``ck.dry_run`` (and ``colab_kit.magics.state`` like ``ck.magics.state``); their aliases are callable, so the
calls keep working after an old import.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

__all__ = ["MOVED", "install", "new_home"]

MOVED = {  # old path -> new path, for 0.1's modules; the whole subtree of a package moves with it
    "colab_kit.engine_records": "colab_kit.engine.records",
    "colab_kit.precision": "colab_kit.engine.precision",
    "colab_kit.recompute": "colab_kit.engine.recompute",
    "colab_kit.sharded_init": "colab_kit.engine.sharded_init",
    "colab_kit.reference": "colab_kit.engine.reference",
    "colab_kit.clipping": "colab_kit.engine.clipping",
    "colab_kit.optimizer": "colab_kit.engine.optimizer",
    "colab_kit.loss": "colab_kit.engine.loss",
    "colab_kit.classes": "colab_kit.engine.classes",
    "colab_kit.fit": "colab_kit.engine.fit",
    "colab_kit.generate": "colab_kit.engine.generate",
    "colab_kit.estimate": "colab_kit.memory.estimator",
    "colab_kit.memory_peak": "colab_kit.memory.peak",
    "colab_kit.memory_timeline": "colab_kit.memory.timeline",
    "colab_kit.dry_run": "colab_kit.planner.at_scale",
    "colab_kit.throughput": "colab_kit.observe.throughput",
    "colab_kit.roofline": "colab_kit.observe.roofline",
    "colab_kit.profile": "colab_kit.observe.profile",
    "colab_kit.tracebacks": "colab_kit.errors.tracebacks",
    "colab_kit.recipe": "colab_kit.models.recipe",
    "colab_kit.data": "colab_kit.zero.stage0",
    "colab_kit.zero.buckets": "colab_kit.zero.stage1",
    "colab_kit.magics.state": "colab_kit.notebook.session",
    "colab_kit.cluster": "colab_kit.notebook.cluster",
    "colab_kit.magics": "colab_kit.notebook.magics",
    "colab_kit.widgets": "colab_kit.notebook.widgets",
    "colab_kit.pipeline.passes": "colab_kit.pipeline.compute",
    "colab_kit.pipeline.p2p": "colab_kit.pipeline.messages",
}


def new_home(name: str) -> str | None:
    """Where the 0.1 module ``name`` lives now, or None if it did not move."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        old = ".".join(parts[:i])
        if old in MOVED:
            return ".".join([MOVED[old], *parts[i:]])
    return None


CALLABLE = {"colab_kit.dry_run": "dry_run", "colab_kit.magics.state": "current"}
"""Old modules named like a function of their package (``ck.dry_run``, ``ck.magics.state``): importing one
binds it over that function, so its alias is callable as the function."""


class _CallableModule(types.ModuleType):
    """The alias of an old module in ``CALLABLE``: the module's names, and callable as the function."""

    def __call__(self, *args, **kwargs):
        return getattr(self, CALLABLE[self.__name__])(*args, **kwargs)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if not name.startswith("colab_kit.") or new_home(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = new_home(spec.name)
        warnings.warn(f"{spec.name} moved to {new} in colab_kit 0.2; the old path goes in the next version",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        if spec.name in CALLABLE:  # bound over a function of the same name: keep that a call
            alias = _CallableModule(spec.name, module.__doc__)
            alias.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
            return alias
        return module

    def exec_module(self, module):
        pass  # the new module ran when it was imported


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finder, which would load a second copy

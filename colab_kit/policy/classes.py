"""Subclasses made at run time that change only ``forward``, the way the parallel parts transform
a model in place: ``module.__class__ = derived_class(...)`` keeps the parameters, their names and
the state-dict keys, and changes what ``forward`` does (recomputation, split_gather's g, ...).

    >>> import torch.nn as nn
    >>> def loud(cls):
    ...     return lambda self, x: cls.forward(self, x) * 2
    >>> Loud = derived_class(nn.Identity, "Loud", loud, __name__, "doubles")
    >>> Loud.__name__, Loud(1)(3.0), derived_class(nn.Identity, "Loud", loud, __name__, "") is Loud
    ('LoudIdentity', 6.0, True)
    >>> derived_from(Loud, "Loud") is nn.Identity, derived_from(nn.Identity, "Loud")
    (True, None)

Which class a derived class was made from is kept here (``derived_from``), not as an attribute of the class.
"""
from __future__ import annotations

import sys

__all__ = ["derived_class", "derived_from"]

_MADE: dict[tuple, type] = {}
_FROM: dict[type, tuple[str, type]] = {}  # a derived class -> (its prefix, the class it was made from)


def derived_from(cls: type, prefix: str) -> type | None:
    """The class ``cls`` was derived from with ``prefix`` (``derived_class``), or None if it was not."""
    made = _FROM.get(cls)
    return made[1] if made is not None and made[0] == prefix else None


def derived_class(cls: type, prefix: str, make_forward, module: str, doc: str, **attrs) -> type:
    """The subclass ``prefix + cls.__name__`` of ``cls`` whose forward is ``make_forward(cls)``,
    made once per (module, prefix, cls) and set as a global of ``module``, so that pickle finds
    it by reference like a class written there; ``attrs`` become class attributes."""
    key = (module, prefix, cls)
    if key not in _MADE:
        name = prefix + cls.__name__
        new = type(name, (cls,), {"forward": make_forward(cls), "__module__": module, "__qualname__": name,
                                  "__doc__": doc, **attrs})
        vars(sys.modules[module]).setdefault(name, new)
        _MADE[key] = new
        _FROM[new] = (prefix, cls)
    return _MADE[key]

"""This machine's measured constants, as the planner caches them: where the file lives (``cache_path``), the
entry for a number of local ranks (``cached``), and one collective's ``alpha`` and ``beta`` from them
(``alpha_beta``).

The measuring is the planner's (``colab_kit.planner.local.constants``, which runs ranks and fits the figures);
reading what it measured is here, below it, because the engine's own reports read it too:
``engine.roofline()`` prices each recorded collective with ``alpha + wire / beta``, and
``peak_matmul`` keeps its figure beside the constants' file.

    >>> alpha_beta({"comm": {"2": {"all_reduce": {"alpha": 1e-4, "beta": 1e9}},
    ...                      "4": {"all_reduce": {"alpha": 2e-4, "beta": 5e8}}}}, "all_reduce", 3)
    (0.0001, 1000000000.0)
"""
from __future__ import annotations

import json
import os
import platform

import torch

__all__ = ["VERSION", "cache_path", "cached", "read_cache", "is_current", "alpha_beta"]

VERSION = 5
"""Bumped when a figure changes meaning or is added; a cached entry of another version is measured again
(version 2: ``dispatch`` per op of a step, not per forward op; ``activation``, ``recompute``, the 4 MiB points;
version 3: ranks bound to cores (``launch.bind_rank``, ``bound``), ``cores`` the ones the process may use,
each point's trials in turns; version 4: the optimizer's ``element_seconds``, both optimizer figures the
slowest rank's; version 5: a pair's all-reduce of 64 KiB or less measured one-shot, as ``comm.all_reduce``
runs it now)."""


def cache_path() -> str:
    """The constants' file: ``$COLAB_KIT_CACHE`` or ``~/.cache/colab_kit``, one per host and torch version."""
    root = os.environ.get("COLAB_KIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "colab_kit")
    return os.path.join(root, f"constants-{platform.node() or 'host'}-{torch.__version__.split('+')[0]}.json")


def read_cache(path: str) -> dict:
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            pass
    return {}


def cached(ranks: int = 4) -> dict | None:
    """The constants cached for ``ranks`` local ranks, or None: nothing is measured."""
    entry = read_cache(cache_path()).get(str(ranks))
    return entry if is_current(entry) else None


def is_current(entry) -> bool:
    """Whether a cached entry is of this ``VERSION`` (an older one counted a step's time per forward op,
    3 times what ``dispatch`` means now, and lacked ``activation`` and ``recompute``)."""
    return isinstance(entry, dict) and entry.get("version") == VERSION


def alpha_beta(consts: dict, op: str, n: int) -> tuple[float, float]:
    """(alpha, beta) of ``op`` on a group of ``n`` ranks (the nearest group size measured; the first of two
    as near)."""
    comm = consts["comm"]
    key = str(n) if str(n) in comm else min(comm, key=lambda k: abs(int(k) - n))
    op = {"reduce": "broadcast", "recv": "send"}.get(op, op)
    c = comm[key].get(op) or comm[key]["send"]  # constants measured before sendrecv had its own
    return c["alpha"], c["beta"]

"""Targets for ``colab_kit.launch.warm.fork_call`` in tests: what a forked child finds when it starts."""
from __future__ import annotations

import json
import os
import sys


def facts(out: str) -> None:
    """Write the child's pid, parent, and whether the engine's modules were imported before this call."""
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "parent": os.getppid(),
                   "warm": [m for m in ("torch._dynamo", "colab_kit.engine.core") if m in sys.modules]}, fh)


def fail(message: str) -> None:
    raise ValueError(message)

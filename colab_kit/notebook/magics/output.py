"""Showing what the ranks printed, grouped per rank (the live progress lines are in ``colab_kit.notebook.progress``)."""
from __future__ import annotations

import json
import sys

from IPython.display import publish_display_data

from ..cluster.results import RankOutput

__all__ = ["show_outputs"]


def show_outputs(outputs: dict[int, RankOutput]) -> None:
    """Print outputs grouped per rank; ranks with identical output share one group."""
    groups: dict[str, list[RankOutput]] = {}
    for out in outputs.values():
        key = json.dumps([out.stdout, out.stderr, out.result, out.status, out.error, out.displays],
                         sort_keys=True, default=str)
        groups.setdefault(key, []).append(out)
    for outs in groups.values():
        o, ranks = outs[0], [x.rank for x in outs]
        if not (o.stdout or o.stderr or o.result is not None or o.displays or o.status != "ok"):
            continue
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        print(f"[{name}]" + {"ok": "", "error": " FAILED", "interrupted": " interrupted",
                                 "stuck": " still running (given up on)"}[o.status])
        if o.stdout:
            print(o.stdout, end="" if o.stdout.endswith("\n") else "\n")
        if o.stderr:
            print(o.stderr, end="" if o.stderr.endswith("\n") else "\n", file=sys.stderr)
        for d in o.displays:
            publish_display_data(d["data"], d["metadata"])
        if o.result is not None:
            print(f"Out[{name}]: {o.result}")
        if o.error:
            print(o.error.rstrip(), file=sys.stderr)
    sys.stdout.flush()

"""ZeRO-3 offload's copies: on a side stream against on the compute stream, one rank, in one run.

``offload="cpu"`` in bf16 moves every host chunk's shard to the GPU for each gather and its reduced gradient
piece back, every step (``colab_kit/zero/copies.py``). The alternative a user has is the same engine with the
copies on the compute stream, the copies back blocking the host (``COLAB_KIT_COPIES=inline``). Both engines are
built from the same weights and take turns step by step (``bench/_gpu_copies.py``, which the GPU check's
``offload_copies`` runs too); printed: each mode's median step, their ratio (side stream / compute stream, goal
below 1), the host syncs a step of each, and the share of the copies' time that ran beside compute kernels
(``torch.profiler``). Written to ``bench/results/zero_streams.json`` on a GPU only. Without one it trains the
CPU's plain copies against lazy ones (CUDA's ordering played on CPU), checks their losses and writes nothing::

    python bench/zero_streams.py
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import colab_kit as ck  # noqa: E402

try:
    from _gpu_copies import STREAMS_SIZES, check_offload_copies  # noqa: E402
    from _results import row, write  # noqa: E402
except ImportError:  # run as a module (python -m bench.zero_streams)
    from bench._gpu_copies import STREAMS_SIZES, check_offload_copies  # noqa: E402
    from bench._results import row, write  # noqa: E402


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ctx = {"cuda": cuda, "sizes": STREAMS_SIZES["cuda" if cuda else "cpu"]}

    def launch(ctx, fn, world, *args):
        return ck.launch(fn, world, *args, backend="nccl" if cuda else "nccl_rules", timeout=600.0)

    ok, figures, detail = check_offload_copies(ctx, launch)
    print(("" if cuda else "no GPU here: plain copies against lazy ones, the losses only; ") + detail)
    if cuda:
        side, inline = (figures["modes"][m]["median_step_s"] for m in ("stream", "inline"))
        write("zero_streams", [row("ZeRO-3 offload='cpu' bf16, one rank: its copies", f"side stream {side * 1e3:.1f} ms",
                                   f"compute stream {inline * 1e3:.1f} ms", side / inline, "median step, s/s")],
              figures, {}, argv)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""How tensor parallelism's traffic scales with the ranks: bytes one rank sends for one transformer block.

The paper's point (Colossal-AI, section 3.2; Optimus, Tesseract and the 3D paper before it): 1D tensor
parallelism sends a whole activation per layer pair however many ranks share it, while 2D, 2.5D and 3D send
pieces that shrink as the group grows. ``block_wire_bytes`` counts it from the same formulas the engine's
layers follow (``tensor.tp1d``, ``tp2d``, ``tp3d``) under the ring model of each collective
(``comm.wire_bytes``): the bytes one rank of the tensor group sends for a block's four Linears (fused qkv,
proj, fc1, fc2), forward and backward. Left out, and small beside them: LayerNorm's row statistics in
2D/2.5D/3D and the once-per-step gradient sums (``grad_sync``).

Per Linear ``d_in -> d_out`` over ``rows`` token rows (e bytes an element):

    1d   (p ranks)          column: backward all-reduce of [rows, d_in]; row: forward all-reduce of
                            [rows, d_out]; each sends 2 (p - 1) / p of it
    2d   (p = q^2)          SUMMA: 3 q broadcasts/reduces of the blocks |A| = rows d_in / (d q^2) and
    2.5d (p = d q^2)        |W| = d_in d_out / q^2 over q ranks, (q - 1) / q of each: 3 (q - 1)(|A| + |W|)
    3d   (p = q^3)          six ring collectives, each (q - 1) / q^3 of X, W or Y:
                            2 (q - 1) / q^3 (rows d_in + d_in d_out + rows d_out)

Worked example, d_model 1024, d_ff 4096, rows 16384 (8 sequences of 2048), fp32, MiB a rank sends for one
block: on 8 ranks 1D 448, 2.5D (q = 2, depth 2) 204, 3D (q = 2) 268; on 64 ranks 1D 504, 2D (q = 8) 162,
3D (q = 4) 100; 1D's share grows towards 2 x 4 activations while the others' shrink::

    >>> from colab_kit.models import GPTConfig
    >>> cfg = GPTConfig(vocab_size=256, seq_len=2048, d_model=1024, n_heads=16, n_layers=1)
    >>> [block_wire_bytes(cfg, mode, 64, rows=16384) >> 20 for mode in ("1d", "2d", "3d")]
    [504, 162, 100]

``tests/ranks/test_tp_scaling.py`` checks the counts against the engine's own records (``tensor.inspect.LayerTraffic``)
for every mode on 4 and 8 ranks; ``viz.planner.tp_scaling_figure`` draws them for growing p, labelled planned.
"""
from __future__ import annotations

import math

__all__ = ["block_wire_bytes", "mode_sizes", "block_linears"]


def block_linears(model) -> list[tuple[int, int, str]]:
    """(d_in, d_out, 1D kind) of a block's four Linears, in the order they run."""
    h, f = model.d_model, model.d_ff
    return [(h, 3 * h, "column"), (h, h, "row"), (h, f, "column"), (f, h, "row")]


def mode_sizes(mode: str, p: int, depth: int = 2) -> tuple[int, int] | None:
    """(q, depth) of ``mode`` on ``p`` ranks, or None where the mode cannot use exactly p ranks."""
    if mode == "1d":
        return (p, 1)
    if mode == "2d":
        q = math.isqrt(p)
        return (q, 1) if q * q == p and q > 1 else None
    if mode == "2.5d":
        q = math.isqrt(p // depth) if p % depth == 0 else 0
        return (q, depth) if q > 1 and depth * q * q == p else None
    if mode == "3d":
        q = round(p ** (1 / 3))
        return (q, 1) if q > 1 and q ** 3 == p else None
    raise ValueError(f"mode must be '1d', '2d', '2.5d' or '3d', got {mode!r}")


def _linear_wire(mode: str, q: int, depth: int, rows: int, d_in: int, d_out: int, kind: str) -> float:
    if mode == "1d":
        return 2 * (q - 1) / q * rows * (d_in if kind == "column" else d_out)
    if mode in ("2d", "2.5d"):
        a, w = rows * d_in / (depth * q * q), d_in * d_out / (q * q)
        return 3 * (q - 1) * (a + w)
    return 2 * (q - 1) / q ** 3 * (rows * d_in + d_in * d_out + rows * d_out)


def block_wire_bytes(model, mode: str, p: int, rows: int, *, depth: int = 2, bytes_per_elem: int = 4) -> int:
    """Bytes one rank of a ``p``-rank tensor group sends for one block's Linears, forward + backward.

    ``rows``: token rows the group works on (the dp-local batch times the sequence). A mode that cannot
    use exactly p ranks is a ValueError saying which counts it takes."""
    sizes = mode_sizes(mode, p, depth)
    if sizes is None:
        takes = {"2d": "a square (4, 9, 16, ...)", "2.5d": f"{depth} x a square (depth {depth}: {4 * depth}, "
                 f"{9 * depth}, ...)", "3d": "a cube (8, 27, 64, ...)"}[mode]
        raise ValueError(f"tp_mode={mode!r} cannot run on {p} tensor ranks: it takes {takes}")
    q, d = sizes
    return int(sum(_linear_wire(mode, q, d, rows, i, o, k) for i, o, k in block_linears(model)) * bytes_per_elem)

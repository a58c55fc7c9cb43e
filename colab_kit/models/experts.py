"""The experts of an MoE layer as stacked tensors, and the dropless dispatch that feeds them.

``Experts(E, d, f)`` holds every expert's GELU MLP in four tensors whose first dim is the expert::

    w_in  [E, d, f]   b_in  [E, f]      expert e: gelu(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]
    w_out [E, f, d]   b_out [E, d]

so a later expert-parallel split is a slice of dim 0 (``Shard(0)`` on the ep axis), not a choice of modules.

Dispatch (``dispatch`` / ``combine``): the ``(token, slot)`` assignments a router chose, ``N x k`` of them,
are sorted by expert with a stable sort (expert-major; inside an expert, token order, then slot order), the
tokens gathered in that order, each expert run on its contiguous run of rows, and the outputs put back in
``(token, slot)`` order and summed over slots with the router's weights. Nothing is dropped unless a capacity
asks (``keep``); an expert that receives no token runs on zero rows, so its weights still get a (zero)
gradient on every rank and no rank's gradient hooks wait for a tensor that another rank produced.

Worked example, 3 tokens, top-2 of 3 experts::

    chosen [[2, 0], [0, 1], [2, 1]]  -> flat (token, slot) 0..5 -> experts [2 0 0 1 2 1]
    stable sort by expert: order [1 2 3 5 0 4] -> rows of tokens [0 1 | 1 2 | 0 2], counts [2 2 2]

The local expert compute (``expert_compute``): three ways measured on this machine (2 cores, one thread,
torch 2.13 CPU, fp32, forward + backward, medians with the three ways taking turns;
``bench_expert_compute(n, d, f, rows)``, run by ``python bench/moe.py``: ``bench/results/moe.json``)::

    experts x d x f, rows          loop     torch._grouped_mm   padded bmm
    4 x 32 x 128,    128 rows      0.79 ms  0.65 ms             0.51 ms
    8 x 32 x 128,    256 rows      1.61 ms  0.92 ms             0.74 ms
    8 x 64 x 256,  1,024 rows      5.07 ms  3.69 ms             3.41 ms
    16 x 64 x 256, 2,048 rows     13.03 ms  7.82 ms             8.64 ms

``torch._grouped_mm`` (it runs on CPU in torch 2.13, with autograd; its backward refuses an expanded
gradient, hence ``_Contiguous``) is kept: never the slowest, the fastest at the largest size, behind the
padded form by 8-27% at the smaller ones where all three take a few milliseconds; the padded form computes on
padding (every expert padded to the busiest), the loop pays a matmul
call per expert. On one H200 (torch 2.11, bf16, 64 experts x 2,048 x 1,408, 65,536 rows, ``python
bench/gpu_moe_check.py speed``): grouped 7.05 ms (322 TFLOP/s of the six GEMMs), padded 11.9 ms, loop
63.3 ms; the bias adds are ``GroupBias`` (the gather's bf16 scatter-add backward was wrong by 31% there and
cost 3 ms). ``EXPERT_COMPUTE`` selects the form
(``"grouped_mm"``, ``"loop"``, ``"padded"``) and ``tests/unit/test_moe.py`` checks all three agree.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Experts", "dispatch", "combine", "expert_compute", "EXPERT_COMPUTE", "bench_expert_compute", "GroupBias"]

EXPERT_COMPUTE = "grouped_mm"
"""The local expert compute ``Experts`` uses: "grouped_mm" (kept, see above), "loop" or "padded"."""


class Experts(nn.Module):
    """``n`` GELU MLPs ``d -> f -> d`` as stacked tensors (see the module docstring)."""

    def __init__(self, n: int, d: int, f: int):
        super().__init__()
        self.n, self.d, self.f = n, d, f
        self.w_in = nn.Parameter(torch.empty(n, d, f))
        self.b_in = nn.Parameter(torch.empty(n, f))
        self.w_out = nn.Parameter(torch.empty(n, f, d))
        self.b_out = nn.Parameter(torch.empty(n, d))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, how: str | None = None) -> torch.Tensor:
        """``rows [M, d]`` in expert-major order, ``counts [n]`` rows per expert -> ``[M, d]``."""
        return expert_compute(rows, counts, self.w_in, self.b_in, self.w_out, self.b_out, how or EXPERT_COMPUTE)


def dispatch(chosen: torch.Tensor, keep: torch.Tensor | None, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)``: the flat ``(token, slot)`` indices of the kept assignments in expert-major order
    (stable: token order inside an expert), and how many each expert receives. ``chosen [N, k]``,
    ``keep [N, k]`` bool or None (dropless)."""
    experts = chosen.reshape(-1)
    if keep is None:
        order = torch.sort(experts, stable=True).indices
    else:
        kept = keep.reshape(-1).nonzero().squeeze(1)
        order = kept[torch.sort(experts[kept], stable=True).indices]
    ones = torch.ones(order.shape, dtype=torch.int64, device=order.device)  # a CUDA bincount syncs for its size
    return order, torch.zeros(n_experts, dtype=torch.int64, device=order.device).index_add_(0, experts[order], ones)


def combine(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Put expert outputs ``out [M, d]`` (rows in ``order``) back at their ``(token, slot)``, zero where an
    assignment was dropped, and sum over slots with ``weights [N, k]``: ``[N, d]``.

    The slots are gathered (``out[where]``, ``where`` each slot's row of ``out``; a dropped slot's is a zero row
    put after them), not scattered into zeros: ``index_copy``'s backward keeps its source for its shape, a second
    ``[M, d]`` beside the slots the weighting keeps; a gather keeps its int64 index only.

        chosen [[2, 0], [0, 1]], experts [2 0 0 1] -> order [1 2 3 0]: where [3 0 1 2] (slot 0 is row 3 of out)
    """
    n, k = weights.shape
    m = out.shape[0]
    where = torch.full((n * k,), m, dtype=torch.int64, device=out.device)  # dropped: the zero row after the rest
    where[order] = torch.arange(m, device=out.device)
    rows = out if m == n * k else torch.cat([out, out.new_zeros(1, out.shape[-1])])
    return (rows[where].view(n, k, -1) * weights[..., None]).sum(1)


def expert_compute(rows, counts, w_in, b_in, w_out, b_out, how: str = "grouped_mm") -> torch.Tensor:
    """Expert ``e`` on its run of ``counts[e]`` rows of ``rows`` (expert-major), each way of ``EXPERT_COMPUTE``."""
    if how == "loop":
        outs = []
        for e, part in enumerate(rows.split(counts.tolist())):  # an empty run still links w_in[e] to the graph
            outs.append(F.gelu(part @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e])
        return torch.cat(outs)
    expert_of = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts,
                                        output_size=rows.shape[0])  # sized here: no host read of the counts
    if how == "grouped_mm":
        offs = counts.cumsum(0).to(torch.int32)
        h = F.gelu(GroupBias.apply(torch._grouped_mm(rows, w_in, offs=offs), b_in, expert_of, counts))
        return GroupBias.apply(_Contiguous.apply(torch._grouped_mm(h, w_out, offs=offs)), b_out, expert_of, counts)
    if how == "padded":
        n, width = len(counts), int(counts.max()) if len(counts) else 0
        start = counts.cumsum(0) - counts
        slot = torch.arange(rows.shape[0], device=rows.device) - start[expert_of]
        padded = rows.new_zeros(n, width, rows.shape[1]).index_put((expert_of, slot), rows)
        h = F.gelu(torch.bmm(padded, w_in) + b_in[:, None])
        return (torch.bmm(h, w_out) + b_out[:, None])[expert_of, slot]
    raise ValueError(f"expert compute {how!r}: one of 'loop', 'grouped_mm', 'padded'")


class GroupBias(torch.autograd.Function):
    """``x + b[expert_of]`` for rows in expert-major order, whose bias gradient is each expert's sum of its run of
    rows accumulated in fp32 (``segment_reduce``, one kernel, deterministic). The plain gather's backward
    scatters with atomic adds in the gradient's dtype: in bf16 on an H200 it put 31% of the largest entry of
    error into ``b_out``'s gradient over 4,096 rows (``bench/gpu_moe_check.py``, ``forms``).

    Rows ``[r0 r1 | r2]``, counts ``[2, 0, 1]``: ``grad_b = [g0 + g1, 0, g2]`` (an expert with no row: zero)."""

    @staticmethod
    def forward(ctx, x, b, expert_of, counts):
        ctx.save_for_backward(counts)
        ctx.b_dtype = b.dtype
        return x + b[expert_of]

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        grad_b = torch.segment_reduce(grad.float(), "sum", lengths=counts, axis=0).to(ctx.b_dtype)
        return grad, grad_b, None, None


class _Contiguous(torch.autograd.Function):
    """Identity whose backward hands a contiguous gradient on (``_grouped_mm``'s backward refuses an expanded one)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def bench_expert_compute(n: int = 8, d: int = 64, f: int = 256, rows: int = 1024, repeat: int = 30,
                         seed: int = 0) -> dict[str, float]:
    """Milliseconds of forward + backward of each way of ``EXPERT_COMPUTE`` on ``rows`` rows routed at random
    (the median of ``repeat`` runs): the measurement quoted in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen, requires_grad=True)
    counts = torch.bincount(torch.randint(0, n, (rows,), generator=gen), minlength=n)
    ws = [torch.randn(*s, generator=gen).mul_(0.05).requires_grad_() for s in ((n, d, f), (n, f), (n, f, d), (n, d))]
    times: dict[str, list[float]] = {how: [] for how in ("loop", "grouped_mm", "padded")}
    for _ in range(repeat):  # the ways take turns: a busy machine slows them alike
        for how, ts in times.items():
            t0 = time.perf_counter()
            expert_compute(x, counts, ws[0], ws[1], ws[2], ws[3], how=how).square().sum().backward()
            ts.append(time.perf_counter() - t0)
    return {how: 1e3 * sorted(ts)[len(ts) // 2] for how, ts in times.items()}

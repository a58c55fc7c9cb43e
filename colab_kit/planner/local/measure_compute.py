"""The compute one rank times for ``constants`` (its module docstring says what each figure means and how
it was checked): ``Burst`` (a tiny GPT's forward and backward, a matmul, a GPT at a model's size, the same
with its blocks recomputed), ``per_call`` (seconds per call with every rank busy alike), ``compute_rates`` (the per-op,
matmul and per-byte figures of a few windows), ``count_ops`` (autograd ops of a graph) and ``optimizer_step``
(an AdamW step and the ops it dispatches)."""
from __future__ import annotations

import statistics
import time

from ...memory.formulas import activation_bytes
from ...models import GPT, GPTConfig
from ...pipeline.costs import flops_per_token
from ...recompute import recompute_blocks

__all__ = ["SYNC", "Burst", "compute_rates", "count_ops", "optimizer_step", "per_call", "timed"]

SYNC = [lambda: None]  # torch.cuda.synchronize on a GPU rank: a time is read after the work is done


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        SYNC[0]()
        t = time.perf_counter()
        fn()
        SYNC[0]()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def optimizer_step(shapes=((64,),) * 32):
    """(ops dispatched by one step, the step) of AdamW over tensors of ``shapes`` (default 32 of 64
    elements: what a small model's optimizer costs is its ops, about 10 per tensor on CPU, where torch
    loops over the tensors; ``measure_rank`` also steps a GPT's parameter shapes for the elements' cost)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # its states exist, as from the second step on

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        opt.step()
    return max(1, Count.ops), opt.step

def per_call(fn, window: float = 0.1) -> float:
    """Seconds per call of ``fn`` repeated by every rank at once for ``window`` seconds from a barrier."""
    import torch.distributed as dist
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window:
        fn()
        n += 1
    SYNC[0]()
    return (time.perf_counter() - t0) / n


def compute_rates(burst, window: float = 0.2, trials: int = 3) -> tuple[list, list, list]:
    """([seconds per op], [matmul FLOPs per second], [seconds per activation byte]) of ``trials`` windows each
    (``per_call``): every rank starts together (a barrier) and repeats the burst's tiny GPT forward and
    backward, then its matmul, then the same GPT at a model's size, for ``window`` seconds of its clock.
    All ranks are busy from the start of a window to its end, so the cores are shared alike all through it
    (a burst timed by itself ends at a different moment on each rank, and the last ones to finish ran alone:
    their per-op reading spread by 30% between two measurements).

    Per op: the tiny GPT's step over 3 ops per forward op (a backward runs about twice its forward's ops);
    its tensors are a few numbers, so its time is the ops' own. Per activation byte: what the sized GPT's
    step takes beyond its ops (at that rate) and its matmul FLOPs (forward and backward, at the matmul
    rate), over the bytes its forward saves for backward (``memory.formulas.activation_bytes``): the
    elementwise work (LayerNorm, GELU, softmax, dropout, adds and their gradients) that grows with the
    activations and that FLOPs do not count."""
    ops, flops, act = [], [], []
    for _ in range(trials):
        per_op = per_call(burst.step, window) / (3 * burst.ops)
        rate = 2 * 256 ** 3 / per_call(burst.matmul, window)
        rest = per_call(burst.step_sized, window) - 3 * burst.sized_ops * per_op - 3 * burst.sized_flops / rate
        ops.append(per_op)
        flops.append(rate)
        act.append(max(0.0, rest) / burst.sized_bytes)
    return ops, flops, act


def count_ops(fn) -> int:
    """Autograd nodes of the graph ``fn()`` builds (its ops that have a backward): walked from the
    output's ``grad_fn``, so nothing but the forward runs."""
    out = fn()
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return max(1, sum(1 for n in seen if type(n).__name__ != "AccumulateGrad"))


class Burst:
    """The compute: a GPT of two blocks with 8 features (``step``, forward and backward: the op mix of
    the model the planner prices, about 60 autograd ops to one ``backward()`` call as in a real step), a
    ``[256, 256] @ [256, 256]`` matmul (``matmul``), both timed in windows by ``compute_rates``; called, the
    load run before each trial of a collective; ``light``, the compute inside a trial."""

    def __init__(self, tiny: int = 2):
        import torch
        import torch.nn.functional as F

        self.lin, self.x = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        g = GPTConfig(vocab_size=8, seq_len=4, d_model=8, n_heads=4, n_layers=2)
        gpt, tokens = GPT(g), torch.zeros(1, 4, dtype=torch.long)
        self._gpt = lambda: F.cross_entropy(gpt(tokens).flatten(0, 1), tokens.flatten())
        self.tiny, self.ops = tiny, count_ops(self._gpt)
        sized = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)  # a model's size, 4 rows
        big, rows = GPT(sized), torch.zeros(4, 32, dtype=torch.long)
        # the optimizer's elements: a GPT's parameters past the caches (d=256, two blocks: 1.6M elements,
        # 26 MB with their gradients and AdamW's two states), as in a step, where forward and backward
        # have streamed activations and gradients through the caches before the optimizer runs
        wide = GPTConfig(vocab_size=64, seq_len=32, d_model=256, n_heads=4, n_layers=2)
        self.optimizer_shapes = [tuple(p.shape) for p in GPT(wide).parameters()]
        self._sized = lambda: F.cross_entropy(big(rows).flatten(0, 1), rows.flatten())
        lin, att, head = flops_per_token(sized)
        self.sized_ops, self.sized_flops = count_ops(self._sized), rows.numel() * (2 * (lin + att) + head)
        self.sized_bytes = activation_bytes(sized, 4)["held"]
        rc = GPT(g)
        recompute_blocks(rc)
        self._gpt_rc = lambda: F.cross_entropy(rc(tokens).flatten(0, 1), tokens.flatten())

        def one_block():
            return gpt.blocks[0](torch.zeros(1, 4, 8, requires_grad=True)).sum()

        self.block_ops = g.n_layers * (count_ops(one_block) - 1)

    def _forward(self):
        import torch
        return torch.nn.functional.gelu(self.lin(self.x)).sum()

    def step(self):
        self._gpt().backward()

    def step_sized(self):
        """A forward and backward of a GPT of a model's size (d=64, 2 blocks, 4 rows of 32 tokens)."""
        self._sized().backward()

    def step_recomputed(self):
        """The same step with every block recomputed (``colab_kit.recompute``)."""
        self._gpt_rc().backward()

    def matmul(self):
        self.a @ self.b

    def __call__(self):
        for _ in range(self.tiny):
            self.step()
        self.matmul()
        SYNC[0]()

    def light(self):
        """One tiny forward and backward: the compute between two collectives of a block."""
        self._forward().backward()

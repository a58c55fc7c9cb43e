"""Ring attention's fused block kernels (``colab_kit.sequence.ring_kernels``): which one a block runs through, the
probe that admits a CUDA kernel only after it matched the explicit block, and the CUDA kernels' calls checked
on the meta device (torch's meta kernels take the same arguments and give the shapes, but compute nothing):
their numbers are first checked by the probe on a lent GPU (``bench/gpu_check.py`` records ``PROBED``)."""
from __future__ import annotations

import pytest
import torch

from colab_kit.sequence import ring_kernels as rk
from colab_kit.sequence.ring import _block_backward, _block_forward


def test_the_cpu_kernel_is_a_block_of_the_explicit_ring():
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, 3, 8, 16, generator=gen, dtype=torch.float64) for _ in range(4))
    o, lse, aux = rk.block_forward("cpu-flash", q, k, v, True, 0.25)
    o_ref, lse_ref = _block_forward(q, k, v, 0.25, True)
    assert aux is None and torch.allclose(o, o_ref) and torch.allclose(lse, lse_ref)
    grads = rk.block_backward("cpu-flash", do, q, k, v, o, lse, True, 0.25, aux)
    for got, want in zip(grads, _block_backward(q, k, v, do, lse_ref, (do * o_ref).sum(-1), 0.25, True)):
        assert torch.allclose(got, want)


def test_which_kernel_a_block_gets():
    q = torch.zeros(1, 2, 8, 16)
    assert rk.kernel_for(q, q, None, None) == "cpu-flash"
    assert rk.kernel_for(q, torch.zeros(1, 2, 8, 8), None, None) is None       # MLA: v narrower than q
    assert rk.kernel_for(q, q, torch.ones(2, 1, 8, dtype=torch.bool), None) is None  # a key mask
    assert rk.kernel_for(q.half(), q.half(), None, None) is None                 # fp16 on CPU: no fused kernel


def test_the_probe_admits_a_kernel_that_matches_and_says_why_not_otherwise():
    cpu = torch.device("cpu")
    assert rk.probe("cpu-flash", torch.float32, 24, cpu) is True
    why = rk.probe("cuda-flash", torch.bfloat16, 24, cpu)  # a CUDA kernel on the CPU: it raises, and is refused
    assert isinstance(why, str) and "NotImplementedError" in why and rk.PROBED[("cpu", torch.bfloat16, 24)] == why


@pytest.mark.parametrize("kind, dtype, rows", [("cuda-flash", torch.bfloat16, 16), ("cuda-flash", torch.float16, 40),
                                               ("cuda-efficient", torch.float32, 40)])
def test_the_cuda_kernels_calls_check_out_on_the_meta_device(kind, dtype, rows):
    """Forward gives O in the input's dtype and an fp32 LSE of one value per query row (the efficient kernel's
    padded one cut back), and the backward takes them with the forward's aux and gives three gradients."""
    q, k, v = (torch.empty(2, 4, rows, 64, device="meta", dtype=dtype) for _ in range(3))
    o, lse, aux = rk.block_forward(kind, q, k, v, True, 0.125)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (2, 4, rows) and lse.dtype == torch.float32
    grads = rk.block_backward(kind, o, q, k, v, o, lse, True, 0.125, aux)
    assert [g.shape for g in grads] == [q.shape] * 3

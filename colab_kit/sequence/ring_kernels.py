"""The fused kernels ring attention runs a block through: torch's own attention kernels that return the block's
log-sum-exp (LSE) and never hold a score block, in the compute dtype.

Which one (``kernel_for``):

- ``"cpu-flash"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (fp32, fp64, bf16);
- ``"cuda-flash"``: ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2; fp16 and bf16);
- ``"cuda-efficient"``: ``aten._scaled_dot_product_efficient_attention`` (memory-efficient attention; fp32), whose
  LSE comes padded to a multiple of 32 rows (cut here, padded back for its backward);
- None: ring attention's explicit blocks in at least fp32 (a key mask, attention dropout, unequal q/k and v
  widths, a head dim the kernels do not take, or a kernel whose probe failed).

Each block's backward is the kernel's own, handed the *final* O and LSE of the query rows (not the block's):
``dS = P (dP - rowsum(dO O))`` with ``P = exp(S - LSE)`` is then that block's share of the whole gradient, as
the explicit blocks compute it. The CUDA kernels' backward also wants what their forward returned besides O and
LSE (sequence lengths, the dropout generator's state): ``block_forward`` returns it as ``aux``.

A CUDA kernel is used only after a probe on its device, dtype and head dim (``probe``: one small causal block
through the kernel's forward and backward against the explicit block, in fp32 references) passed in this process:
a kernel that raises, or disagrees, leaves ring attention on its explicit blocks, and ``PROBED`` says so
(``bench/gpu_check.py`` records it). On CPU the kernel is the one the suite tests. Worked example, bf16 on
an H100 with head dim 64: ``kernel_for`` gives ``"cuda-flash"`` once ``probe`` passed; a block of 2 x 8 x 512
queries against 512 keys returns O ``bf16[2, 8, 512, 64]`` and LSE ``fp32[2, 8, 512]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PROBED", "block_backward", "block_forward", "kernel_for", "probe"]

_aten = torch.ops.aten
PROBED: dict[tuple[str, torch.dtype, int], bool | str] = {}
"""(device type, dtype, head dim) -> True, or why the CUDA kernel is not used (its error or disagreement)."""


def kernel_for(q: torch.Tensor, v: torch.Tensor, keys, drop) -> str | None:
    """The fused kernel for ring attention's blocks of ``q`` (module docstring), or None."""
    if keys is not None or drop is not None or v.shape[-1] != q.shape[-1]:
        return None
    if q.device.type == "cpu":
        return "cpu-flash" if q.dtype in (torch.float32, torch.float64, torch.bfloat16) else None
    if q.device.type != "cuda" or q.shape[-1] % 8 or q.shape[-1] > 256:
        return None
    kind = "cuda-flash" if q.dtype in (torch.float16, torch.bfloat16) else \
        "cuda-efficient" if q.dtype == torch.float32 else None
    return kind if kind is not None and probe(kind, q.dtype, q.shape[-1], q.device) is True else None


def block_forward(kind: str, q, k, v, causal: bool, scale: float) -> tuple:
    """``(O, LSE, aux)`` of queries ``q`` against keys ``k``, values ``v`` (``[b, h, t, d]``); ``causal``: the
    diagonal block (queries and keys of the same positions)."""
    if kind == "cpu-flash":
        o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o, lse, None
    if kind == "cuda-flash":
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return o, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    o, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                         scale=scale)
    return o, lse[..., :q.shape[2]], (lse.shape[-1], seed, offset)


def block_backward(kind: str, do, q, k, v, out, lse, causal: bool, scale: float, aux) -> tuple:
    """``(dQ, dK, dV)`` of one block, given the final ``out`` and ``lse`` (fp32) of its query rows."""
    if kind == "cpu-flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal,
                                                                          scale=scale)
    if kind == "cuda-flash":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return _aten._scaled_dot_product_flash_attention_backward(do, q, k, v, out, lse.contiguous(), cum_q, cum_k,
                                                                  max_q, max_k, 0.0, causal, seed, offset,
                                                                  scale=scale)
    rows, seed, offset = aux
    padded = F.pad(lse, (0, rows - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def probe(kind: str, dtype: torch.dtype, d: int, device: torch.device) -> bool | str:
    """Whether ``kind`` computes a causal block and its gradients as the explicit blocks do, on this device,
    dtype and head dim (once per process; the verdict, or why not, in ``PROBED``)."""
    key = (device.type, dtype, d)
    if key not in PROBED:
        PROBED[key] = _check(kind, dtype, d, device)
    return PROBED[key]


def _check(kind: str, dtype: torch.dtype, d: int, device) -> bool | str:
    from .ring import _block_backward, _block_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 64, d, generator=gen).to(device) for _ in range(4))
    scale, tol = d ** -0.5, (3e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4)
    try:
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        o, lse, aux = block_forward(kind, qd, kd, vd, True, scale)
        grads = block_backward(kind, do.to(dtype), qd, kd, vd, o, lse.float(), True, scale, aux)
    except Exception as exc:  # noqa: BLE001 - the kernel is not for this device, dtype or width: say why
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    o_ref, lse_ref = _block_forward(q, k, v, scale, True)
    ref = _block_backward(q, k, v, do, lse_ref, (do * o_ref).sum(-1), scale, True)
    worst = max(float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6))
                for a, b in ((o, o_ref), (lse, lse_ref), *zip(grads, ref)))
    return True if worst <= tol else f"disagrees with the explicit block by {worst:.2e} (> {tol:g})"

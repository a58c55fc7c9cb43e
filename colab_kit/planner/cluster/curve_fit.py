"""A node preset from measurements on the GPU itself: the cost model's constants fitted on ``bench/gpu_curves.py``.

``bench/gpu_curves.py`` times, on one GPU, bf16 GEMMs of many shapes, torch's flash attention forward and
backward, HBM streams and the experts' grouped GEMM, and writes ``bench/results/gpu_curves.json``. This module
turns those curves into the figures ``planner.cluster.hardware.Hardware`` prices with:

- ``fit_gemm``: the matmul curve's ``(e_max, knee)``, the curve of ``Hardware.gemm_rate`` (``peak * e_max * f(m)
  f(n) f(k)``, ``f(d) = d / (d + knee)``) bounded by HBM as ``Hardware.gemm_seconds`` bounds it, by least squares
  on the log of the rate (e_max in closed form for each knee, the knee on a refined grid, as
  ``bench/estimate.py --calibrate`` refines its grid on Table 1);
- ``fit_attention``: (forward, backward) fractions of the peak of SDPA's flash kernel at the papers' best case
  (the longest sequence at the widest head), FlashAttention's FLOP count (``attention_flops``);
  ``attention_falloff`` says how far they fall at short sequences and head dim 64 (not priced: one pair);
- ``hbm_efficiency``: the fraction of the datasheet's HBM bandwidth a large copy and a large add reach;
- ``measured_preset(base, curves)``: ``base`` with those four figures replaced, each with its source; the
  datasheet peak stays. ``carry_over`` / ``h100_from_h200`` / ``h200_from_h100``: another GPU of the same tensor
  cores with the efficiencies measured on the one that was lent and its own datasheet HBM;
- ``preset_for_device``: the preset a measurement of a device is fitted against, by the name torch gives it
  (``NVIDIA H100 80GB HBM3`` -> ``8xH100-SXM``): a GEMM's fraction of the peak and HBM's of the datasheet are only
  meaningful against the datasheet of the GPU that ran them.

Worked example: GEMM points made by the curve itself (e_max 0.7, knee 120, H200's peak and bandwidth) give
those constants back; points of another curve do not give the Table 1 fit::

    >>> bw = 4.8e12 * 0.9
    >>> shapes = [(m, n, k) for m in (512, 4096, 16384) for n in (256, 2048, 8192) for k in (256, 4096)]
    >>> pts = [(m, n, k, 2 * m * n * k / curve_seconds(m, n, k, 0.7, 120.0, 989e12, bw)) for m, n, k in shapes]
    >>> e, knee = fit_gemm(pts, 989e12, bw)
    >>> round(e, 3), round(knee, 1)
    (0.7, 120.0)
    >>> attention_flops(1, 32, 16384, 128, causal=True) / 1e12          # 4 b h s^2 d / 2: the forward
    2.199023255552
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

from .hardware import HARDWARE, Hardware

__all__ = ["attention_falloff", "attention_flops", "carry_over", "curve_seconds", "fit_attention", "fit_gemm",
           "grouped_vs_curve", "h100_from_h200", "h200_from_h100", "hbm_efficiency", "load_curves", "measured_preset",
           "preset_for_device"]

BACKWARD = 2.5
"""FlashAttention's backward FLOPs over its forward's (Dao 2023, Sec. 4.1): five products against two."""
MEASURED = ("e_max", "knee", "attention_efficiency", "hbm_efficiency")
"""The ``Hardware`` fields ``measured_preset`` replaces (its datasheet figures stay)."""
LAUNCH = ("op_seconds", "kernel_seconds", "family_op_seconds")
"""Replaced too where the curves have the host's sweeps (``gpu_curves.py``'s ``launch`` and ``program``)."""


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> float:
    """FLOPs of one flash attention forward, FlashAttention's count: ``4 b h s^2 d`` (QK^T and PV), halved when
    causal; the backward is ``BACKWARD`` times it (``planner.cluster.compute.flash`` prices the same count)."""
    return 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)


def curve_seconds(m: float, n: float, k: float, e_max: float, knee: float, peak: float,
                  bytes_per_s: float | None = None, size: int = 2) -> float:
    """Seconds of one (m x k) @ (k x n) product on the matmul curve: ``Hardware.gemm_seconds`` less its kernel
    gap (a GEMM timed alone by CUDA events has none), the HBM bound applied when ``bytes_per_s`` is given."""
    compute = 2.0 * m * n * k / (peak * e_max * (m / (m + knee)) * (n / (n + knee)) * (k / (k + knee)))
    memory = size * (m * k + k * n + m * n) / bytes_per_s if bytes_per_s else 0.0
    return max(compute, memory)


def _rates(points) -> list[tuple[float, float, float, float]]:
    """``(m, n, k, FLOP/s)`` of GEMM points given as such tuples or as ``gpu_curves`` dicts (m, n, k, seconds);
    a dict without seconds (a shape that failed) is left out."""
    out = []
    for p in points:
        if not isinstance(p, dict):
            m, n, k, rate = (float(x) for x in p)
            out.append((m, n, k, rate))
        elif p.get("seconds"):
            out.append((p["m"], p["n"], p["k"], 2.0 * p["m"] * p["n"] * p["k"] / p["seconds"]))
    return out


MIN_FIT_SECONDS = 20e-6
"""GEMMs shorter than this at the datasheet peak are left out of ``fit_gemm`` (where at least 3 longer ones are
timed): a kernel's fixed few microseconds on the GPU are a large share of their time, the curve has no term
for them (``Hardware.gemm_seconds`` adds its ``kernel_seconds`` apart), and on a log scale those points pull
the fit to an e_max above 1. Worked example: GEMMs made by e_max 0.8, knee 60 plus 4 us each gave e_max 1.28,
knee 499 with them, 0.80 without (``tests/unit/test_measured.py``)."""


def fit_gemm(points, peak: float = 989e12, bytes_per_s: float | None = None) -> tuple[float, float]:
    """``(e_max, knee)`` minimising the squared log ratio of the curve's rate to each point's measured rate,
    over the points of at least ``MIN_FIT_SECONDS`` at the peak.

    ``points``: ``(m, n, k, FLOP/s)`` tuples or ``gpu_curves`` dicts; ``peak``: the datasheet peak the fraction
    is of; ``bytes_per_s``: the HBM bandwidth reached (datasheet x ``hbm_efficiency``) for the roofline, as the
    cost model applies it, or None for the curve alone. For a given knee the best e_max is closed-form, the
    geometric mean of the compute-bound points' measured / shape-curve rates (those the roofline leaves alone,
    found again as e_max moves); the knee is searched on [0, 2048], a grid of 41 refined six times to +-1 step
    of the best (the module docstring's example recovers its constants)."""
    pts = _rates(points)
    if not pts:
        raise ValueError("fit_gemm needs at least one timed GEMM point")
    long = [p for p in pts if 2.0 * p[0] * p[1] * p[2] / peak >= MIN_FIT_SECONDS]
    pts = long if len(long) >= 3 else pts  # a CPU's smoke run: every shape is tiny against a GPU's peak

    def shape(m: float, n: float, k: float, c: float) -> float:
        return (m / (m + c)) * (n / (n + c)) * (k / (k + c))

    def best_e(c: float) -> float:
        logs = [(math.log(r / (peak * shape(m, n, k, c))), m, n, k) for m, n, k, r in pts]
        e = math.exp(statistics.mean(x for x, *_ in logs))
        for _ in range(8):  # the compute-bound set at this e_max, and e_max over it, until neither moves
            bound = [x for x, m, n, k in logs
                     if curve_seconds(m, n, k, e, c, peak, bytes_per_s) <= curve_seconds(m, n, k, e, c, peak)]
            new = math.exp(statistics.mean(bound)) if bound else e
            if abs(new - e) <= 1e-12 * e:
                break
            e = new
        return e

    def loss(c: float) -> tuple[float, float, float]:
        e = best_e(c)
        return sum(math.log(r * curve_seconds(m, n, k, e, c, peak, bytes_per_s) / (2.0 * m * n * k)) ** 2
                   for m, n, k, r in pts), c, e

    lo, hi = 0.0, 2048.0
    best = (math.inf, 0.0, 0.0)
    for _ in range(7):
        best = min([best] + [loss(lo + (hi - lo) * j / 40) for j in range(41)])
        step = (hi - lo) / 40
        lo, hi = max(0.0, best[1] - step), best[1] + step
    return best[2], best[1]


def _sig(x: float) -> float:
    """``x`` to six significant digits (a CPU's fraction of an H200's peak is 1e-5, not 0)."""
    return float(f"{x:.6g}")


def _fractions(p: dict, peak: float) -> tuple[float, float]:
    """(forward, backward) fractions of ``peak`` one attention point reached."""
    f = attention_flops(p["batch"], p["heads"], p["seq"], p["head_dim"], p.get("causal", True))
    return f / p["forward_seconds"] / peak, BACKWARD * f / p["backward_seconds"] / peak


def _timed(points) -> list[dict]:
    return [p for p in points if p.get("forward_seconds") and p.get("backward_seconds")]


def fit_attention(points, peak: float = 989e12) -> tuple[float, float]:
    """(forward, backward) fractions of ``peak`` at the papers' best case: the point of the widest head dim,
    among those the longest sequence (FlashAttention-2's figures are head dim 128 at 16k tokens).

    >>> p = {"batch": 1, "heads": 32, "seq": 16384, "head_dim": 128, "causal": True}
    >>> f = attention_flops(1, 32, 16384, 128)
    >>> fit_attention([{**p, "forward_seconds": f / 400e12, "backward_seconds": 2.5 * f / 300e12}], 1000e12)
    (0.4, 0.3)
    """
    timed = _timed(points)
    if not timed:
        raise ValueError("fit_attention needs at least one timed attention point")
    best = max(timed, key=lambda p: (p["head_dim"], p["seq"]))
    f, b = _fractions(best, peak)
    return _sig(f), _sig(b)


def attention_falloff(points, peak: float = 989e12) -> list[dict]:
    """Every timed attention point's (forward, backward) fractions of ``peak`` and of the best case's: how much
    less the kernel reaches at short sequences or head dim 64 than the one pair the preset prices with."""
    best_f, best_b = fit_attention(points, peak)
    out = []
    for p in sorted(_timed(points), key=lambda p: (p["head_dim"], p["seq"])):
        f, b = _fractions(p, peak)
        out.append({"seq": p["seq"], "head_dim": p["head_dim"], "forward": round(f, 4), "backward": round(b, 4),
                    "forward_vs_best": round(f / best_f, 3), "backward_vs_best": round(b / best_b, 3)})
    return out


def hbm_efficiency(points, bytes_per_s: float, ops=("copy", "add")) -> float:
    """The mean over ``ops`` of the bandwidth each reached at its largest size (bytes read and written over
    seconds), as a fraction of the datasheet's ``bytes_per_s``.

    >>> hbm_efficiency([{"op": "copy", "bytes": 8e9, "seconds": 2e-3}, {"op": "add", "bytes": 3e9, "seconds": 1e-3},
    ...                 {"op": "add", "bytes": 12e9, "seconds": 3e-3}], 5e12)
    0.8
    """
    rates = []
    for op in ops:
        mine = [p for p in points if p.get("op") == op and p.get("seconds")]
        if mine:
            big = max(mine, key=lambda p: p["bytes"])
            rates.append(big["bytes"] / big["seconds"])
    if not rates:
        raise ValueError(f"hbm_efficiency needs a timed point of one of {ops}")
    return _sig(statistics.mean(rates) / bytes_per_s)


def grouped_vs_curve(points, hw: Hardware, precision: str = "bf16") -> list[dict]:
    """Each grouped expert GEMM timed (E experts, ``rows_per_expert`` x d_model @ d_model x d_expert) against what
    the cost model prices for it (``planner.moe.price``: ``hw.gemm_seconds(rows, d_expert, d_model, count=E)``,
    E dense GEMMs with their kernel gaps): ``ratio`` measured / priced, above 1 where the price is optimistic."""
    out = []
    for p in points:
        if not p.get("seconds"):
            continue
        priced = hw.gemm_seconds(p["rows_per_expert"], p["d_expert"], p["d_model"], precision, p["experts"])
        out.append({k: p[k] for k in ("experts", "rows_per_expert", "d_model", "d_expert")}
                   | {"measured_s": p["seconds"], "priced_s": priced, "ratio": round(p["seconds"] / priced, 3)})
    return out


def load_curves(path: str) -> dict:
    """The curves ``bench/gpu_curves.py`` wrote (JSON), refused with what is missing if they are not."""
    with open(path, encoding="utf-8") as fh:
        curves = json.load(fh)
    missing = [k for k in ("device", "date", "gemm", "attention", "hbm") if k not in curves]
    if missing:
        raise ValueError(f"{path} is not a gpu_curves file (no {', '.join(missing)}): make one on the GPU with "
                         "`python bench/gpu_curves.py`")
    return curves


def measured_preset(base: Hardware, curves: dict) -> Hardware:
    """``base`` with the matmul curve, attention's and HBM's efficiencies measured (``curves``: ``load_curves``),
    and, where the curves have the host's sweeps, the host's seconds an operator (``op_seconds`` and
    ``family_op_seconds``: the floor of ``planner.cluster.host``) and the GPU's seconds a tiny kernel
    (``kernel_seconds``; ``_host_figures``),
    each replaced figure's source naming the device, the date and the script; the datasheet peak, HBM
    bandwidth and everything else stay ``base``'s, and so does the name (``Estimate.peak_flops`` looks the
    peak up by it). The GEMMs are fitted against the measured HBM bound, and in bf16; the same fractions are
    taken for fp16 and fp32."""
    where = f"measured on {curves['device']} {curves['date']} by bench/gpu_curves.py"
    peak = base.peak("bf16")
    hbm = hbm_efficiency(curves["hbm"], base.memory_bytes_per_s)
    e_max, knee = fit_gemm(curves["gemm"], peak, base.memory_bytes_per_s * hbm)
    fwd, bwd = fit_attention(curves["attention"], peak)
    best = max(_timed(curves["attention"]), key=lambda p: (p["head_dim"], p["seq"]))
    rates = _rates(curves["gemm"])
    dims = [d for r in rates for d in r[:3]]
    gemm = (f"{where}: {len(rates)} bf16 GEMMs of {min(dims):g}-{max(dims):g} fitted by least squares on the log "
            f"rate (planner.cluster.curve_fit.fit_gemm): e_max {e_max:.3f}, knee {knee:.1f}, of the "
            f"{peak / 1e12:g} TFLOP/s datasheet peak, bounded by the measured HBM")
    sources = {**base.sources, "e_max, knee": gemm, "e_max": gemm, "knee": gemm,
               "attention_efficiency": (f"{where}: torch SDPA flash (FlashAttention-2), causal, bf16, seq "
                                        f"{best['seq']}, head dim {best['head_dim']}, {best['heads']} heads: "
                                        f"forward {fwd:.3f}, backward {bwd:.3f} of the peak by FlashAttention's "
                                        "FLOP count (less at short sequences and head dim 64: "
                                        "planner.cluster.curve_fit.attention_falloff)"),
               "hbm_efficiency": (f"{where}: a large copy and add reach {hbm:.3f} of the datasheet's "
                                  f"{base.memory_bytes_per_s / 1e12:g} TB/s (bytes read and written)")}
    extra = _host_figures(curves, where, sources)
    return replace(base, e_max=e_max, knee=knee, attention_efficiency=(fwd, bwd), hbm_efficiency=hbm,
                   sources=sources, source=f"{base.source}; efficiencies {where}", **extra)


def _host_figures(curves: dict, where: str, sources: dict) -> dict:
    """The host's figures of ``curves`` (``planner.cluster.host``'s floor), their sources written into ``sources``:
    ``family_op_seconds`` from the ``program`` sweep (each family's own step at a tiny width, timed / operators
    counted) and ``op_seconds`` the built-in GPT's of them; without that sweep, ``op_seconds`` from the ``launch``
    sweep's tiny ``add_`` (the cheapest operator: a lower bound). ``kernel_seconds`` from ``launch``."""
    extra: dict = {}
    launch = curves.get("launch") or {}
    add = launch.get("host_seconds_per_op")
    program = {p["family"]: p for p in curves.get("program") or [] if p.get("seconds_per_op")}
    if program:
        extra["family_op_seconds"] = {f: p["seconds_per_op"] for f, p in program.items()}
        each = "; ".join(f"{f}: {p['ops']} operators in {p['step_seconds'] * 1e3:.2f} ms, "
                         f"{p['seconds_per_op'] * 1e6:.2f} us each" for f, p in program.items())
        sources["family_op_seconds"] = (f"{where}: each family's training step at a tiny width on one rank (bf16, "
                                        f"AdamW), the host's seconds / the operators counted ({each})"
                                        + (f"; a tiny add_ takes {add * 1e6:.2f} us" if add else ""))
        dense = program.get("gpt") or min(program.values(), key=lambda p: p["seconds_per_op"])
        extra["op_seconds"] = dense["seconds_per_op"]
        sources["op_seconds"] = (f"{where}: the {dense['family']} family's training step at a tiny width, "
                                 f"{dense['seconds_per_op'] * 1e6:.2f} us of host time an operator (program sweep)")
    elif add:
        extra["op_seconds"] = add
        sources["op_seconds"] = (f"{where}: {launch['kernels']} tiny add_ kernels issued from Python, "
                                 f"{add * 1e6:.2f} us of host time each (the cheapest operator: a lower bound)")
    if launch.get("device_seconds_per_op"):
        extra["kernel_seconds"] = launch["device_seconds_per_op"]
        sources["kernel_seconds"] = (f"{where}: tiny kernels queued ahead, run back to back on the GPU: "
                                     f"{launch['device_seconds_per_op'] * 1e6:.2f} us each")
    return extra


def carry_over(measured: Hardware, target: Hardware) -> Hardware:
    """``target`` with ``measured``'s efficiencies (``MEASURED``, and ``LAUNCH`` where measured: the host's figure
    then is the lent machine's CPU, taken for the target's, said so in its source), for a GPU of the same
    tensor cores: its own
    datasheet peak and HBM bandwidth stay, so memory-bound parts scale by the datasheets' bandwidth ratio."""
    ratio = target.memory_bytes_per_s / measured.memory_bytes_per_s
    note = (f"carried over from {measured.name} (the same tensor cores); memory-bound parts scale by the "
            f"datasheets' HBM ratio {target.memory_bytes_per_s / 1e12:g} / {measured.memory_bytes_per_s / 1e12:g} "
            f"= {ratio:.2f}: ")
    launch = [f for f in LAUNCH if "measured on" in measured.sources.get(f, "")]  # the host's too, said so
    carried = ("e_max, knee", "e_max", "knee", "attention_efficiency", "hbm_efficiency", *launch)
    sources = {**target.sources, **{k: note + measured.sources.get(k, "given") for k in carried}}
    return replace(target, **{f: getattr(measured, f) for f in (*MEASURED, *launch)}, sources=sources,
                   source=f"{target.source}; efficiencies carried over from {measured.name} ({measured.source})")


def h100_from_h200(h200_measured: Hardware) -> Hardware:
    """The H100 SXM preset with the efficiencies measured on an H200 (``carry_over``): H100's 3.35 TB/s HBM3
    against H200's 4.8 TB/s HBM3e, the same 989 TFLOP/s bf16 peak."""
    return carry_over(h200_measured, HARDWARE["8xH100-SXM"])


def h200_from_h100(h100_measured: Hardware) -> Hardware:
    """The H200 SXM preset with the efficiencies measured on an H100 SXM (``carry_over``): the same tensor cores
    and 989 TFLOP/s bf16 peak, H200's 4.8 TB/s HBM3e against H100's 3.35 TB/s."""
    return carry_over(h100_measured, HARDWARE["8xH200-SXM"])


_DEVICE_PRESETS = (("H200", "8xH200-SXM", ("NVL", "GH200")), ("H100", "8xH100-SXM", ("PCIE", "NVL", "96GB")),
                   ("H800", "8xH800-SXM", ("PCIE",)), ("A100", "8xA100-80GB", ("40GB", "PCIE")))
"""(what the device's name holds, its preset, variants of that name whose datasheet the preset is not)."""


def preset_for_device(device: str) -> str:
    """The name of the preset a GPU's measurements are fitted against, from ``torch.cuda.get_device_name``:
    ``"NVIDIA H100 80GB HBM3"`` -> ``"8xH100-SXM"``, ``"NVIDIA H200"`` -> ``"8xH200-SXM"``. A name that matches
    none (the CPU of ``--cpu-smoke``) gets the H200's, the preset the curves were first made for. A variant with
    another datasheet (an H100 PCIe or NVL, an A100 40GB) is refused, saying what would work, not fitted against
    the wrong peak or bandwidth."""
    upper = device.upper()
    for key, name, others in _DEVICE_PRESETS:
        if key in upper:
            if any(v in upper for v in others):
                raise ValueError(f"{device!r} is not the GPU of the {name} preset (its datasheet peak or HBM "
                                 f"differ): fit its curves with measured_preset against a Hardware of its own "
                                 f"datasheet")
            return name
    return "8xH200-SXM"

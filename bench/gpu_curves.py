"""What one GPU computes and moves, measured for the at-scale cost model: run by hand where a GPU is lent.

Six sweeps, bf16, each point the median of 20 CUDA-event timings after 3 warm-up runs. The runs of a
point are queued behind a ``torch.cuda._sleep`` kernel, so each pair of events times the GPU's work alone, not
the host's launches; before each GEMM run a 256 MiB buffer is zeroed, so no operand stays in the 60 MB L2:

1. ``gemm``: ``a @ b``, (m x k) @ (k x n), on a log grid of 256-16384 (cubes; m of 4096 or 16384 tokens with n
   and k of 256-16384, the shapes tp shards make; m of 256 or 1024 rows) and the GPT blocks' own GEMMs of
   ``bench/gpu_estimate_check.py`` (forward, dX and dW of qkv, proj, fc1, fc2, and the head), 2 m n k FLOPs;
2. ``attention``: ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, causal,
   32 heads of dim 64 and 128, seq 1k-16k at 16k tokens a call (batch 16k / seq), forward and backward timed
   apart; FlashAttention's FLOPs (``planner.cluster.curve_fit.attention_flops``: ``4 b h s^2 d / 2``, backward 2.5x);
3. ``hbm``: ``dst.copy_(src)`` (2 x bytes moved) and ``torch.add(a, b, out=c)`` (3 x) on 64 MiB-4 GiB tensors;
4. ``grouped``: the experts' first GEMM as the engine runs it (``colab_kit.models.experts.expert_compute``:
   ``torch._grouped_mm(rows, w_in, offs=...)``), E experts of (rows x d_model) @ (d_model x d_expert), at the
   widths of DeepSeek-V2-Lite (64 x 2048 x 1408), Mixtral 8x7B (8 x 4096 x 14336), Qwen3-30B-A3B (128 x 2048 x
   768) and DeepSeek-V3 under ep=8 (32 x 7168 x 2048), 64-4096 rows per expert;
5. ``launch``: a 1,024-element ``add_`` issued 800 times (under the ~1,024 launches CUDA queues before the host
   blocks, so the GPU's time per op is its own): host seconds per op (torch's dispatch and the launch)
   and GPU seconds per op queued back to back (``Hardware.kernel_seconds``'s assumption is 3 us);
6. ``program``: each family the host's floor counts trained at a tiny width on one rank of this GPU (``ck.boost``,
   NCCL, bf16, AdamW; ``bench/_host_program.py``): the step's host seconds / its operators counted, the host
   seconds an operator of that program (``Hardware.family_op_seconds``; a tiny ``add_`` is the cheapest one).

A point, worked: ``{"m": 8192, "n": 8192, "k": 8192, "seconds": 1.395e-3, "tflops": 788.2}``, 2 x 8192^3 =
1.10e12 FLOPs in 1.395 ms (the 788 TFLOP/s one H200 here reached on that shape); an attention point of seq 16384,
head dim 128 (batch 1, 32 heads) does 2.2e12 FLOPs forward, so 6.5 ms is 0.34 of the 989 TFLOP/s peak.

``bench/results/gpu_curves.json`` holds every point, the device, torch and CUDA versions, nvidia-smi's clocks
before and after the GEMMs, the date, and the fit ``planner.cluster.curve_fit.measured_preset`` makes of them (e_max,
knee, attention's and HBM's efficiencies) against the preset of the GPU that ran them (``preset_for_device``:
an H100 SXM's against ``8xH100-SXM``, carried over to ``8xH200-SXM`` and the other way), which
``bench/gpu_estimate_check.py`` prices with. About a minute on
an H200. Exit 2 without CUDA (and without ``--cpu-smoke``).

``--cpu-smoke``: the same code paths on the CPU with tiny sizes (perf_counter instead of events), in seconds; its
JSON goes to ``--out`` (default: a temp file), never over the GPU's::

    python bench/gpu_curves.py
    python bench/gpu_curves.py --cpu-smoke --out /tmp/gpu_curves_smoke.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from colab_kit.planner.cluster.hardware import HARDWARE  # noqa: E402
from colab_kit.planner.cluster.curve_fit import (BACKWARD, attention_falloff, attention_flops, carry_over,  # noqa: E402
                                                 grouped_vs_curve, measured_preset, preset_for_device)

try:
    from _host_program import measure_program  # noqa: E402
    from _results import gpu_or_smoke, machine, row  # noqa: E402
except ImportError:  # python -m bench.gpu_curves
    from bench._host_program import measure_program  # noqa: E402
    from bench._results import gpu_or_smoke, machine, row  # noqa: E402

GPTS = ((16384, 768), (16384, 1024), (16384, 2048))  # (tokens, d_model) of gpu_estimate_check's GPTs, batch 16
VOCAB = 25600


def _gemm_shapes() -> list[tuple[int, int, int]]:
    """(m, n, k) of the CUDA sweep, each once, in order: about 80 shapes."""
    grid = (256, 1024, 4096, 16384)
    shapes = [(d, d, d) for d in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    shapes += [(m, n, k) for m in (4096, 16384) for n in grid for k in grid]
    shapes += [(m, n, k) for m in (256, 1024) for n in (4096, 16384) for k in (4096, 16384)]
    for t, h in GPTS:
        for n, k in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
            shapes += [(t, n, k), (t, k, n), (k, n, t)]  # forward, dX, dW
        shapes.append((t, VOCAB, h))
    return list(dict.fromkeys(shapes))


SIZES = {
    "cuda": dict(warmup=3, reps=20, gemm=_gemm_shapes(), heads=32, tokens=16384, seqs=(1024, 2048, 4096, 8192, 16384),
                 head_dims=(64, 128), hbm=tuple(2 ** p for p in (26, 28, 30, 32)), flush=256 * 2 ** 20,
                 grouped=((64, 2048, 1408), (8, 4096, 14336), (128, 2048, 768), (32, 7168, 2048)),
                 rows=(64, 128, 256, 512, 1024, 2048, 4096), launches=800),
    "cpu": dict(warmup=1, reps=3, gemm=[(32, 32, 32), (64, 16, 32), (16, 64, 64)], heads=2, tokens=128,
                seqs=(32, 64), head_dims=(8, 16), hbm=(2 ** 20, 2 ** 22), flush=2 ** 16, grouped=((4, 32, 16),),
                rows=(4, 16), launches=50),
}
SLEEP_CYCLES = 50_000_000  # about 25 ms at the H200's 1.98 GHz: the host queues a point's runs meanwhile


class Timer:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup``; ``before()`` runs untimed before each run
    (a cache flush, attention's forward before its backward). On CUDA every run sits between two events, the
    runs queued behind a sleeping kernel; on the CPU, ``time.perf_counter``."""

    def __init__(self, cuda: bool, warmup: int, reps: int):
        self.cuda, self.warmup, self.reps = cuda, warmup, reps

    def __call__(self, fn, before=None) -> float:
        for _ in range(self.warmup):
            if before:
                before()
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize()
            marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(self.reps)]
            torch.cuda._sleep(SLEEP_CYCLES)
            for start, end in marks:
                if before:
                    before()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times = [start.elapsed_time(end) / 1e3 for start, end in marks]
        else:
            for _ in range(self.reps):
                if before:
                    before()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _point(what: dict, measure) -> dict:
    """``what`` with ``measure()``'s figures, or with the error that stopped it (the sweep goes on)."""
    try:
        return {**what, **measure()}
    except Exception as exc:  # an unsupported shape or an OOM is a result, not the end of the sweep
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**what, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}


def sweep_gemm(timer: Timer, sizes: dict, dev, dtype) -> list[dict]:
    flush = torch.empty(sizes["flush"], dtype=torch.uint8, device=dev)

    def one(m, n, k):
        a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
        s = timer(lambda: a @ b, flush.zero_)
        return {"seconds": s, "tflops": round(2 * m * n * k / s / 1e12, 2)}
    return [_point({"m": m, "n": n, "k": k}, lambda: one(m, n, k)) for m, n, k in sizes["gemm"]]


def sweep_attention(timer: Timer, sizes: dict, dev, dtype) -> list[dict]:
    h = sizes["heads"]

    def one(b, s, d):
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        grad, held = torch.randn(b, h, s, d, device=dev, dtype=dtype), {}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fwd = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            held.update(out=F.scaled_dot_product_attention(q, k, v, is_causal=True))  # the kernel's name, once
            kernel = held["out"].grad_fn.name()

            def forward():
                held["out"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            bwd = timer(lambda: torch.autograd.grad(held["out"], (q, k, v), grad), forward)
        flops = attention_flops(b, h, s, d, causal=True)
        return {"forward_seconds": fwd, "backward_seconds": bwd, "kernel": kernel,
                "forward_tflops": round(flops / fwd / 1e12, 2), "backward_tflops": round(BACKWARD * flops / bwd / 1e12, 2)}
    return [_point({"batch": max(1, sizes["tokens"] // s), "heads": h, "seq": s, "head_dim": d, "causal": True},
                   lambda: one(max(1, sizes["tokens"] // s), s, d)) for d in sizes["head_dims"] for s in sizes["seqs"]]


def sweep_hbm(timer: Timer, sizes: dict, dev, dtype) -> list[dict]:
    def one(fn, moved):
        s = timer(fn)
        return {"seconds": s, "gb_per_s": round(moved / s / 1e9, 1)}
    out = []
    for nbytes in sizes["hbm"]:
        a, b, c = (torch.randn(nbytes // dtype.itemsize, device=dev, dtype=dtype) for _ in range(3))
        for op, moved, fn in (("copy", 2, lambda: c.copy_(a)), ("add", 3, lambda: torch.add(a, b, out=c))):
            out.append(_point({"op": op, "tensor_bytes": nbytes, "bytes": moved * nbytes},
                              lambda: one(fn, moved * nbytes)))
    return out


def sweep_grouped(timer: Timer, sizes: dict, dev, dtype) -> list[dict]:
    flush = torch.empty(sizes["flush"], dtype=torch.uint8, device=dev)

    def one(e, d, f, r):
        rows, w = torch.randn(e * r, d, device=dev, dtype=dtype), torch.randn(e, d, f, device=dev, dtype=dtype)
        offs = (torch.arange(1, e + 1, device=dev) * r).to(torch.int32)  # each expert's run ends here
        s = timer(lambda: torch._grouped_mm(rows, w, offs=offs), flush.zero_)
        return {"seconds": s, "tflops": round(2 * e * r * d * f / s / 1e12, 2)}
    return [_point({"experts": e, "rows_per_expert": r, "d_model": d, "d_expert": f}, lambda: one(e, d, f, r))
            for e, d, f in sizes["grouped"] for r in sizes["rows"]]


def measure_launch(cuda: bool, sizes: dict, dev) -> dict:
    """Seconds per tiny kernel: issued from Python (host-bound) and, on CUDA, run back to back on the GPU."""
    x, n = torch.zeros(1024, device=dev), sizes["launches"]
    for _ in range(10):
        x.add_(1.0)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    if cuda:
        torch.cuda.synchronize()
    out = {"kernels": n, "host_seconds_per_op": (time.perf_counter() - t0) / n}
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES * 2)  # the host queues all n meanwhile
        start.record()
        for _ in range(n):
            x.add_(1.0)
        end.record()
        torch.cuda.synchronize()
        out["device_seconds_per_op"] = start.elapsed_time(end) / 1e3 / n
    return out


def clocks() -> dict | None:
    """nvidia-smi's reading of the GPU's clocks, power and temperature now; None where there is no nvidia-smi."""
    fields = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.draw",
              "power.limit", "temperature.gpu")
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode or not done.stdout.strip():
        return None
    return dict(zip(fields, (v.strip() for v in done.stdout.splitlines()[0].split(","))))


def summary(curves: dict) -> tuple[dict, list[dict]]:
    """The fit ``measured_preset`` makes of ``curves`` on the preset of the GPU that ran them
    (``preset_for_device``: an H100 SXM's against 8xH100-SXM), the same efficiencies carried over to the other
    of H100 and H200 (``carry_over``: the same tensor cores, its own datasheet HBM), and the result file's rows."""
    name = preset_for_device(curves["device"])
    hw = measured_preset(HARDWARE[name], curves)
    other = {"8xH200-SXM": "8xH100-SXM", "8xH100-SXM": "8xH200-SXM"}.get(name)
    carried = carry_over(hw, HARDWARE[other]) if other else None
    peak = hw.peak("bf16") / 1e12
    gemm = [p for p in curves["gemm"] if "seconds" in p]
    top = max(gemm, key=lambda p: p["tflops"])
    hbm = [p for p in curves["hbm"] if "seconds" in p]
    grouped = grouped_vs_curve(curves["grouped"], hw)
    fit = {"e_max": hw.e_max, "knee": hw.knee, "attention_efficiency": hw.attention_efficiency,
           "hbm_efficiency": hw.hbm_efficiency, "attention_falloff": attention_falloff(curves["attention"], peak * 1e12),
           "grouped_vs_curve": grouped, "preset": f"{name} (planner.cluster.curve_fit.measured_preset)"}
    if carried is not None:
        fit["carried_over"] = {"preset": other, "source": carried.sources["e_max"]}
    dims = [d for p in gemm for d in (p["m"], p["n"], p["k"])]
    rows = [row(f"bf16 GEMM, {len(gemm)} shapes of {min(dims)}-{max(dims)}", f"best {top['tflops']:g} TFLOP/s at "
                f"{top['m']}x{top['n']}x{top['k']}; fit e_max {hw.e_max:.3f}, knee {hw.knee:.1f}",
                f"datasheet {peak:g} TFLOP/s", top["tflops"] / peak, "measured; e_max, knee fitted on every shape"),
            row("SDPA flash, causal, best case", f"forward {hw.attention_efficiency[0]:.3f}, backward "
                f"{hw.attention_efficiency[1]:.3f} of the peak", "FlashAttention-2 on H100: 0.34, 0.34", None,
                "measured; FlashAttention's FLOP count"),
            row("HBM, largest copy and add", ", ".join(f"{p['op']} {p['gb_per_s']:g} GB/s" for p in hbm[-2:]),
                f"datasheet {hw.memory_bytes_per_s / 1e9:g} GB/s", hw.hbm_efficiency, "measured")]
    if grouped:
        worst = max(grouped, key=lambda g: g["ratio"])
        rows.append(row("grouped expert GEMM vs E dense GEMMs priced", f"measured / priced up to {worst['ratio']:g} "
                        f"({worst['experts']} x {worst['rows_per_expert']} rows x {worst['d_model']} x "
                        f"{worst['d_expert']})", None, None, "the price: planner.moe.price's dense GEMMs"))
    if hw.family_op_seconds:
        fit["family_op_seconds"] = hw.family_op_seconds
        add = (curves.get("launch") or {}).get("host_seconds_per_op")
        rows.append(row("host seconds an operator of a training step (tiny width, one rank)", ", ".join(
            f"{f} {s * 1e6:.2f} us" for f, s in hw.family_op_seconds.items()),
            f"a tiny add_: {add * 1e6:.2f} us" if add else None, hw.op_seconds / add if add else None,
            "measured; the host's floor (planner.cluster.host) prices each family's own"))
    return fit, rows


def _dump(curves: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(curves, fh, indent=1, default=str)
        fh.write("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="the same sweeps, tiny, on the CPU")
    ap.add_argument("--out", help="the JSON to write (default: bench/results/gpu_curves.json on CUDA, a temp "
                                  "file with --cpu-smoke)")
    args = ap.parse_args(argv)
    cuda, out = gpu_or_smoke("gpu_curves", args.cpu_smoke, args.out)
    if out is None:
        return 2
    sizes, dev, dtype = SIZES["cuda" if cuda else "cpu"], torch.device("cuda" if cuda else "cpu"), torch.bfloat16
    timer, t0 = Timer(cuda, sizes["warmup"], sizes["reps"]), time.perf_counter()
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    try:
        preset_for_device(device)  # before a minute of sweeps, not after
    except ValueError as exc:
        print(f"gpu_curves: {exc}", file=sys.stderr)
        return 2
    curves = {"benchmark": "gpu_curves", "mode": "cuda" if cuda else "cpu-smoke", "device": device,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cuda": torch.version.cuda,
              "dtype": "bf16", "clocks": {"before": clocks() if cuda else None}}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        curves["properties"] = {"multiprocessors": props.multi_processor_count, "total_memory": props.total_memory,
                                "capability": f"{props.major}.{props.minor}"}
    for name, sweep in (("gemm", sweep_gemm), ("attention", sweep_attention), ("hbm", sweep_hbm),
                        ("grouped", sweep_grouped)):
        t = time.perf_counter()
        try:
            curves[name] = sweep(timer, sizes, dev, dtype)
        except Exception as exc:  # noqa: BLE001 - outside a point (an allocation): the sweep's one error, the rest run
            curves[name] = [{"error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
        bad = sum("error" in p for p in curves[name])
        print(f"{name:<10} {len(curves[name])} points ({bad} failed) in {time.perf_counter() - t:.1f} s", flush=True)
        if name == "gemm" and cuda:
            curves["clocks"]["after_gemm"] = clocks()
    _dump(curves, out)  # the points first: nothing after this may lose them
    try:
        curves["launch"] = measure_launch(cuda, sizes, dev)
    except Exception as exc:  # noqa: BLE001 - recorded; the preset keeps its assumption
        curves["launch"] = {"error": f"{type(exc).__name__}: {exc}"}
    _dump(curves, out)  # the launch sweep kept before the program sweep's spawn
    t = time.perf_counter()
    try:  # inside gpu_session.sh's 230 s for the whole script
        curves["program"] = measure_program(cuda, timeout=max(60.0, 200.0 - (t - t0)) if cuda else None)
    except Exception as exc:  # noqa: BLE001 - recorded; the preset falls back to the launch sweep
        curves["program"] = [{"error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
    print(f"program    {len(curves['program'])} families in {time.perf_counter() - t:.1f} s: " + ", ".join(
        f"{p['family']} {p['seconds_per_op'] * 1e6:.1f} us/op" if "seconds_per_op" in p else
        f"{p.get('family', '?')} {'skipped' if 'skipped' in p else 'failed'}" for p in curves["program"]), flush=True)
    ok = all(any("error" not in p for p in curves[k]) for k in ("gemm", "attention", "hbm", "grouped"))
    try:
        if not ok:
            raise ValueError("a sweep has no timed point: see the points' errors")
        curves["fit"], curves["rows"] = summary(curves)
        for r in curves["rows"]:
            print(f"  {r['what']}: {r['colab_kit']} ({r['peer']})")
    except Exception as exc:  # noqa: BLE001 - the points stay in the file, the fit's failure beside them
        ok = False
        curves["rows"] = [row("GPU curves", f"not fitted: {type(exc).__name__}: {exc}", None, None, "see the points")]
    curves.update(seconds=round(time.perf_counter() - t0, 1), command=" ".join(["python", "bench/gpu_curves.py",
                  *(sys.argv[1:] if argv is None else argv)]), when=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  machine=machine())
    _dump(curves, out)
    print(f"{'done' if ok else 'INCOMPLETE'} in {curves['seconds']} s on {device}; curves in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

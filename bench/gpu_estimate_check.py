"""Checked on the GPU itself: training steps timed on one GPU beside ``ck.estimate``'s step for each.

On one CUDA GPU, through ``ck.boost`` on one rank (``ck.launch(fn, 1)``, NCCL, as ``bench/gpu_check.py``'s
``gpt`` check runs its 125M GPT), bf16, AdamW, seq 1024, batch 16, 3 warm-up steps then the median of 10 (each
step synchronised):

- the 125M GPT of ``gpu_check`` (d 768, 12 layers, 12 heads, vocab 25,600: ``gpu_check.SIZES``), a 350M GPT
  (d 1024, 24 layers, 16 heads) and a 1.3B GPT (d 2048, 24 layers, 16 heads), each with recompute "none" and
  "full"; a config that runs out of memory is skipped with the error recorded;
- the MoE GPT of ``bench/gpu_moe_check.py``'s ``bf16`` check (d 512, 12 layers, 8 experts of 1024, top-2, seq
  512, batch 16), recompute "none".

Beside each: ``ck.estimate(model, config, batch, hardware=hw)`` on one GPU, ``hw`` the H200 preset with the
efficiencies ``bench/gpu_curves.py`` measured (``planner.cluster.curve_fit.measured_preset`` of
``bench/results/gpu_curves.json``, or ``--curves``; the datasheet preset where there is none, said so), and on
the datasheet preset too. A row per config: estimate / measured (the target is within 10%; a benchmark, not
asserted), and the activations the estimate counts against what the engine's meter measured on the device's own
kernels (CUDA's LayerNorm keeps fp32 statistics, its flash attention its own log-sum-exp: ``memory.saves``, counted
on CPU's). Rows and figures (steps, losses, peak memory beside the estimate's, the estimates' breakdowns) go to
``bench/results/gpu_estimate_check.json`` through ``bench/_results.py``. Exit 0 when a config ran, 1 when none
did, 2 without CUDA (and without ``--cpu-smoke``). Run ``bench/gpu_curves.py`` first.

Worked example of a row: 125M, recompute none, measured 40.5 ms a step (gpu_check's 404,217 tokens/s on an
H200), the datasheet preset's 30.2 ms: ratio 0.75, the estimate 25% fast.

``--cpu-smoke``: tiny GPTs (gpu_check's CPU sizes) and a tiny MoE in fp32 on one CPU rank (gloo), priced on the
same preset to exercise the path, in seconds; JSON to ``--out`` (default: a temp file), never over the GPU's::

    python bench/gpu_estimate_check.py
    python bench/gpu_estimate_check.py --cpu-smoke --out /tmp/gpu_estimate_smoke.json
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, BENCH):  # colab_kit from this checkout; gpu_check and _results beside this file
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

import _results  # noqa: E402
import colab_kit as ck  # noqa: E402
from colab_kit.datasets import SyntheticTokens  # noqa: E402
from colab_kit.models import GPT, GPTConfig  # noqa: E402
from colab_kit.planner.cluster.hardware import HARDWARE  # noqa: E402
from colab_kit.planner.cluster.curve_fit import load_curves, measured_preset, preset_for_device  # noqa: E402
from gpu_check import SIZES as CHECK_SIZES  # noqa: E402

CURVES = os.path.join(ROOT, "bench", "results", "gpu_curves.json")
_MOE = dict(vocab_size=256, seq_len=512, d_model=512, n_heads=8, n_layers=12, n_experts=8, top_k=2, d_expert=1024,
            aux_loss=0.01)  # bench/gpu_moe_check.py's bf16 check
MODES = {
    "cuda": dict(precision="bf16", warmup=3, timed=10, backend="nccl", timeout=280.0, where="one GPU", models=[
        ("125M GPT (gpu_check)", CHECK_SIZES["cuda"]["gpt"], 16, ("none", "full")),
        ("350M GPT", dict(vocab_size=25600, seq_len=1024, d_model=1024, n_heads=16, n_layers=24), 16, ("none", "full")),
        ("1.3B GPT", dict(vocab_size=25600, seq_len=1024, d_model=2048, n_heads=16, n_layers=24), 16, ("none", "full")),
        ("MoE GPT (gpu_moe_check)", _MOE, 16, ("none",))]),
    "cpu": dict(precision="fp32", warmup=1, timed=2, backend=None, timeout=120.0, where="one CPU rank", models=[
        ("tiny GPT (gpu_check's CPU size)", CHECK_SIZES["cpu"]["gpt"], 8, ("none", "full")),
        ("tiny MoE GPT", dict(vocab_size=64, seq_len=16, d_model=16, n_heads=2, n_layers=2, n_experts=4, top_k=2,
                              d_expert=32), 8, ("none",))]),
}


def _rank_steps(jobs: list[dict], mode: dict, progress: str | None = None) -> list[dict]:
    """On the one rank: each job's model built once on the CPU (a copy per recompute mode, not drawn again), boosted,
    trained ``warmup + timed`` steps, each step synchronised and timed on the host; an error ends that job only.
    Each finished job is also appended to ``progress`` (a JSON line), which the caller reads if the rank is
    stopped at its timeout."""
    out, built = [], {}
    for job in jobs:
        r, engine, model = dict(job), None, None
        try:
            cfg = GPTConfig(**job["model"])
            if job["name"] not in built:
                built = {job["name"]: GPT(cfg)}  # the previous model's CPU copy freed
            model = copy.deepcopy(built[job["name"]])
            r["parameters"] = model.num_parameters()
            engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=3e-4),
                              ck.ParallelConfig(precision=mode["precision"], recompute=job["recompute"]))
            cuda = engine.mesh.device.type == "cuda"
            data, times, losses = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=2), [], []
            for s in range(mode["warmup"] + mode["timed"]):
                batch = data.batch(s, job["batch"])
                t0 = time.perf_counter()
                losses.append(engine.train_step(batch))
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            r.update(step_seconds=statistics.median(times[mode["warmup"]:]), step_times=times, losses=losses,
                     device=str(engine.mesh.device),  # train_step resets the peak: the last step's
                     last_step_max_memory_allocated=torch.cuda.max_memory_allocated() if cuda else None,
                     measured_activations=engine.memory()["activations"])  # the meter's, on this device's kernels
        except torch.cuda.OutOfMemoryError as exc:
            r["skipped"] = f"out of memory: {str(exc).splitlines()[0][:300]}"
        except Exception as exc:  # recorded; the other configs still run
            r["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            r["traceback"] = traceback.format_exc()
        finally:
            if engine is not None:
                engine.close()
            engine = model = None  # nothing of this job left on the device for the next
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        out.append(r)
        if progress:
            with open(progress, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(r, default=str) + "\n")
    return out


def preset_for(device: str, curves_path: str | None) -> tuple:
    """``(datasheet preset, preset priced with, one line saying which)``: the preset of the GPU's name
    (``curve_fit.preset_for_device``), with ``measured_preset`` of the curves where the file exists and was
    measured on a GPU of the same preset (curves of another are not used, and the line says so: their fractions
    are of another datasheet; the measured step times are kept either way)."""
    try:
        name = preset_for_device(device)
    except ValueError as exc:  # after the run: its measured times are kept, the ratios flagged
        return HARDWARE["8xH200-SXM"], HARDWARE["8xH200-SXM"], f"8xH200-SXM as shipped, NOT this GPU's: {exc}"
    base = HARDWARE[name]
    if curves_path and os.path.exists(curves_path):
        try:
            curves = load_curves(curves_path)
            measured_preset(base, curves)
        except (ValueError, KeyError) as exc:  # an INCOMPLETE curves file (a sweep with no timed point)
            return base, base, f"{name} as shipped (datasheet): {curves_path} cannot be fitted: {exc}"
        if preset_for_device(curves["device"]) != name:
            return base, base, (f"{name} as shipped (datasheet): {curves_path} was measured on {curves['device']}, "
                                f"another preset's GPU; run bench/gpu_curves.py on this one first")
        hw = measured_preset(base, curves)
        return base, hw, (f"{name} with e_max {hw.e_max:.3f}, knee {hw.knee:.1f}, attention "
                          f"{hw.attention_efficiency[0]:.3g}/{hw.attention_efficiency[1]:.3g}, HBM {hw.hbm_efficiency:.3g} "
                          f"measured on {curves['device']} {curves['date']} ({curves_path})")
    return base, base, f"{name} as shipped (datasheet; no {curves_path or CURVES}: run bench/gpu_curves.py first)"


def price(results: list[dict], mode: dict, base, hw, label: str) -> tuple[list[dict], list[dict]]:
    """Each measured config's estimate on ``hw`` and on the datasheet ``base``: the result file's rows and figures."""
    rows, figures = [], []
    for r in results:
        cfg = GPTConfig(**r["model"])
        config = ck.ParallelConfig(precision=mode["precision"], recompute=r["recompute"])
        what = (f"{r['name']}, recompute {r['recompute']}, batch {r['batch']} x {cfg.seq_len}, "
                f"{mode['precision']}, {mode['where']}")
        if "step_seconds" not in r:
            rows.append(_results.row(what, "skipped", None, None, r.get("skipped", "")))
            figures.append(r)
            continue
        est, sheet = (ck.estimate(cfg, config, r["batch"], hardware=h) for h in (hw, base))
        m, acts = r["step_seconds"], r.get("measured_activations")
        acts_ratio = est.memory["activations"] / acts if acts else None
        rows.append(_results.row(what, f"estimate {est.step_seconds * 1e3:.1f} ms/step", f"measured {m * 1e3:.1f} ms/step",
                                 est.step_seconds / m, f"target within 10% (not asserted); on {label}; the datasheet "
                                 f"preset's {sheet.step_seconds * 1e3:.1f} ms ({sheet.step_seconds / m:.3f})"
                                 + (f"; activations estimate / measured {acts_ratio:.3f}" if acts_ratio else "")))
        figures.append({**r, "estimate_seconds": est.step_seconds, "ratio": est.step_seconds / m,
                        "datasheet_seconds": sheet.step_seconds, "datasheet_ratio": sheet.step_seconds / m,
                        "breakdown": est.breakdown, "estimate_device_bytes": est.device_bytes,
                        "estimate_memory": {k: est.memory[k] for k in ("params", "grads", "optimizer", "activations")},
                        "activations_ratio": acts_ratio,
                        "mfu_measured": est.model_flops / m / base.peak(mode["precision"]) if "cuda" in
                        r.get("device", "") else None})
    return rows, figures


def _write(out: str | None, rows: list[dict], figures: dict, args: dict) -> str:
    """``_results.write`` to bench/results/gpu_estimate_check.json, or moved to ``out``."""
    if out is None:
        return _results.write("gpu_estimate_check", rows, figures, args)
    keep, tmp = _results.RESULTS, tempfile.mkdtemp()
    try:
        _results.RESULTS = tmp
        path = _results.write("gpu_estimate_check", rows, figures, args)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        shutil.move(path, out)
    finally:
        _results.RESULTS = keep
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on one CPU rank, the same code paths")
    ap.add_argument("--out", help="the JSON to write (default: bench/results/gpu_estimate_check.json on CUDA, a "
                                  "temp file with --cpu-smoke)")
    ap.add_argument("--curves", default=CURVES, help="gpu_curves.py's JSON for the measured preset")
    args = ap.parse_args(argv)
    cuda, out = _results.gpu_or_smoke("gpu_estimate_check", args.cpu_smoke, args.out)
    if out is None:
        return 2
    mode = MODES["cuda" if cuda else "cpu"]
    jobs = [{"name": name, "model": model, "batch": batch, "recompute": rc}
            for name, model, batch, modes in mode["models"] for rc in modes]
    t0 = time.perf_counter()
    progress = out + ".progress"
    if os.path.exists(progress):
        os.remove(progress)
    try:
        results = ck.launch(_rank_steps, 1, jobs, mode, progress, backend=mode["backend"], timeout=mode["timeout"])[0]
    except Exception as exc:  # the rank died or ran past its time: the jobs it finished kept, the rest said so
        text = exc.summary() if isinstance(exc, ck.RankError) else f"{type(exc).__name__}: {exc}"
        with open(progress, encoding="utf-8") if os.path.exists(progress) else open(os.devnull) as fh:
            done = [json.loads(line) for line in fh if line.strip().endswith("}")]  # not a line cut short
        results = done + [{**job, "skipped": f"the rank failed: {text[:500]}"} for job in jobs[len(done):]]
    if os.path.exists(progress):
        os.remove(progress)
    device = torch.cuda.get_device_name(0) if cuda else "cpu"  # after the rank: no CUDA context here before it
    base, hw, label = preset_for(device, args.curves)
    rows, figures = price(results, mode, base, hw, label)
    for r, f in zip(rows, figures):
        print(f"{r['what']}: {r['colab_kit']} vs {r['peer']}" + (f", ratio {r['ratio']:.3f}" if r["ratio"] else "")
              + ("" if "ratio" in f else f" ({f.get('skipped')})"), flush=True)
    print(f"priced on {label}")
    path = _write(out, rows, {"device": device, "preset": label, "configs": figures,
                              "seconds": round(time.perf_counter() - t0, 1)},
                  {"mode": "cuda" if cuda else "cpu-smoke", "curves": args.curves})
    ran = sum("step_seconds" in r for r in results)
    print(f"{ran} of {len(results)} configs ran; results in {path}")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())

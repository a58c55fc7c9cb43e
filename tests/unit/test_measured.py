"""A preset from the GPU's own curves (``colab_kit.planner.cluster.curve_fit``): the fits give back the constants of points
made by the curve itself and not another curve's, the preset names where each replaced figure was measured, and
``bench/gpu_curves.py`` / ``bench/gpu_estimate_check.py`` run their code paths on the CPU (``--cpu-smoke``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import colab_kit as ck
from colab_kit.models import GPTConfig
from colab_kit.planner.cluster.hardware import CALIBRATED, HARDWARE
from colab_kit.planner.cluster.curve_fit import (MEASURED, attention_falloff, attention_flops, carry_over, curve_seconds,
                                        fit_attention, fit_gemm, grouped_vs_curve, h100_from_h200, h200_from_h100,
                                        hbm_efficiency, load_curves, measured_preset, preset_for_device)

ROOT = Path(__file__).resolve().parents[2]
H200 = HARDWARE["8xH200-SXM"]
PEAK, BW = 989e12, 4.8e12
SHAPES = ([(d, d, d) for d in (256, 1024, 4096, 16384)]
          + [(m, n, k) for m in (4096, 16384) for n in (256, 1024, 4096) for k in (256, 2048, 16384)]
          + [(16384, 2304, 768), (16384, 768, 3072), (768, 3072, 16384)])


def _gemm(e_max, knee, bytes_per_s=None, shapes=SHAPES):
    points = [{"m": m, "n": n, "k": k, "seconds": curve_seconds(m, n, k, e_max, knee, PEAK, bytes_per_s)}
              for m, n, k in shapes]
    return [{**p, "tflops": 2 * p["m"] * p["n"] * p["k"] / p["seconds"] / 1e12} for p in points]


def _attention(fwd, bwd, short=0.5):
    """Points reaching ``fwd``, ``bwd`` of the peak at the longest seq and head dim 128, ``short`` of that elsewhere."""
    out = []
    for d in (64, 128):
        for s in (1024, 4096, 16384):
            scale = 1.0 if (d, s) == (128, 16384) else short
            f = attention_flops(16384 // s, 32, s, d)
            out.append({"batch": 16384 // s, "heads": 32, "seq": s, "head_dim": d, "causal": True,
                        "forward_seconds": f / (PEAK * fwd * scale), "backward_seconds": 2.5 * f / (PEAK * bwd * scale)})
    return out


def _curves(e_max=0.7, knee=100.0, hbm=0.9, attn=(0.5, 0.4)):
    big = 4 * 2 ** 30
    return {"device": "NVIDIA H200", "date": "2026-12-05", "gemm": _gemm(e_max, knee, BW * hbm),
            "attention": _attention(*attn),
            "hbm": [{"op": "copy", "bytes": 2 * big, "seconds": 2 * big / (BW * hbm)},
                    {"op": "add", "bytes": 3 * big, "seconds": 3 * big / (BW * hbm)},
                    {"op": "add", "bytes": 3 * 2 ** 26, "seconds": 1.0}],  # small: not the one read
            "grouped": [{"experts": 64, "rows_per_expert": 1024, "d_model": 2048, "d_expert": 1408, "seconds": 1e-3}]}


# ------------------------------------------------------------------ the fits
@pytest.mark.parametrize("e_max, knee", [(0.72, 140.0), (0.6, 59.3), (0.9, 400.0)])
def test_fit_gemm_recovers_the_curve_that_made_the_points(e_max, knee):
    e, c = fit_gemm(_gemm(e_max, knee), PEAK)
    assert e == pytest.approx(e_max, rel=1e-3) and c == pytest.approx(knee, rel=1e-3, abs=0.1)


def test_fit_gemm_recovers_it_under_the_hbm_roofline_too():
    bw, skinny = BW * 0.85, [(16384, 16384, 64), (8192, 64, 8192), (16384, 32, 4096)]  # attention-like, HBM-bound
    points = _gemm(0.9, 30.0, bw, SHAPES + skinny)
    slow = [p for p in points if curve_seconds(p["m"], p["n"], p["k"], 0.9, 30.0, PEAK) < p["seconds"]]
    assert len(slow) >= 2, "some points must be memory bound for this test to mean anything"
    e, c = fit_gemm(points, PEAK, bw)
    assert e == pytest.approx(0.9, rel=1e-3) and c == pytest.approx(30.0, rel=1e-3)
    e, c = fit_gemm(points, PEAK)  # the roofline left out: the memory-bound points drag the curve down
    assert e < 0.89 or c > 31


def test_fit_gemm_rejects_the_wrong_answer():
    e, c = fit_gemm(_gemm(0.6, CALIBRATED["knee"]), PEAK)
    assert abs(e - CALIBRATED["e_max"]) > 0.1 and e == pytest.approx(0.6, rel=1e-3)
    e, c = fit_gemm(_gemm(CALIBRATED["e_max"], 250.0), PEAK)
    assert abs(c - CALIBRATED["knee"]) > 100


def test_fit_gemm_takes_rate_tuples_and_skips_failed_shapes():
    tuples = [(p["m"], p["n"], p["k"], 2 * p["m"] * p["n"] * p["k"] / p["seconds"]) for p in _gemm(0.7, 90.0)]
    assert fit_gemm(tuples, PEAK) == pytest.approx(fit_gemm(_gemm(0.7, 90.0) + [{"m": 8, "n": 8, "k": 8,
                                                                                 "error": "OOM"}], PEAK))
    with pytest.raises(ValueError, match="at least one"):
        fit_gemm([{"m": 8, "n": 8, "k": 8, "error": "OOM"}])


def test_curve_seconds_is_the_cost_models_gemm_less_its_kernel_gap():
    for m, n, k in SHAPES:
        want = H200.gemm_seconds(m, n, k, "bf16") - H200.kernel_seconds
        got = curve_seconds(m, n, k, H200.e_max, H200.knee, H200.peak("bf16"), H200.memory_bytes_per_s * H200.hbm_efficiency)
        assert got == pytest.approx(want, rel=1e-12)


def test_fit_attention_reads_the_best_case_and_reports_the_falloff():
    points = _attention(0.55, 0.45, short=0.6)
    assert fit_attention(points, PEAK) == pytest.approx((0.55, 0.45))
    fall = attention_falloff(points, PEAK)
    assert len(fall) == 6 and fall[-1]["seq"] == 16384 and fall[-1]["head_dim"] == 128
    assert all(f["forward_vs_best"] == pytest.approx(0.6) for f in fall[:-1])
    with pytest.raises(ValueError, match="at least one"):
        fit_attention([{"seq": 1024, "head_dim": 64, "error": "no kernel"}])


def test_hbm_efficiency_is_the_largest_streams_fraction_of_the_datasheet():
    assert hbm_efficiency(_curves(hbm=0.87)["hbm"], BW) == pytest.approx(0.87)
    assert hbm_efficiency(_curves(hbm=0.87)["hbm"], BW, ops=("copy",)) == pytest.approx(0.87)
    with pytest.raises(ValueError):
        hbm_efficiency([], BW)


# ------------------------------------------------------------------ the preset
def test_measured_preset_replaces_the_four_figures_each_with_its_source():
    hw = measured_preset(H200, _curves())
    assert hw.e_max == pytest.approx(0.7, rel=1e-3) and hw.knee == pytest.approx(100.0, rel=1e-3)
    assert hw.hbm_efficiency == pytest.approx(0.9) and hw.attention_efficiency == pytest.approx((0.5, 0.4))
    assert hw.name == H200.name and hw.flops == H200.flops and hw.memory_bytes_per_s == H200.memory_bytes_per_s
    for figure in MEASURED + ("e_max, knee",):
        assert "measured on NVIDIA H200 2026-12-05 by bench/gpu_curves.py" in hw.sources[figure], figure
        assert hw.sources[figure] != H200.sources.get(figure)
    assert hw.sources["flops"] == H200.sources["flops"] and "measured on NVIDIA H200" in hw.source
    assert H200.e_max == CALIBRATED["e_max"] and H200.attention_efficiency == (0.34, 0.34)  # the base untouched
    notes = "\n".join(ck.estimate(GPTConfig(vocab_size=25600, seq_len=1024, d_model=768, n_heads=12, n_layers=12),
                                  ck.ParallelConfig(precision="bf16"), 16, hardware=hw).assumptions)
    assert "0.7 of peak" in notes and "measured on NVIDIA H200" in notes


def test_the_estimate_moves_with_the_measured_efficiencies():
    gpt, cfg = GPTConfig(vocab_size=25600, seq_len=1024, d_model=1024, n_heads=16, n_layers=24), ck.ParallelConfig(
        precision="bf16")
    slow, fast = (ck.estimate(gpt, cfg, 16, hardware=measured_preset(H200, _curves(e_max=e))).step_seconds
                  for e in (0.5, 0.9))
    assert slow > 1.4 * fast


def test_h100_from_h200_keeps_the_efficiencies_and_h100s_hbm():
    h200 = measured_preset(H200, _curves())
    h100 = h100_from_h200(h200)
    assert h100.name == "8xH100-SXM" and h100.memory_bytes_per_s == 3.35e12 and h100.flops == h200.flops
    assert all(getattr(h100, f) == getattr(h200, f) for f in MEASURED)
    for figure in MEASURED:
        assert "carried over from 8xH200-SXM" in h100.sources[figure] and "3.35 / 4.8 = 0.70" in h100.sources[figure]
        assert "measured on NVIDIA H200" in h100.sources[figure]
    assert carry_over(h200, HARDWARE["8xH800-SXM"]).intra == HARDWARE["8xH800-SXM"].intra


def test_a_kernels_fixed_microseconds_do_not_pull_the_fit_above_the_peak():
    """Each GEMM timed 4 us longer than the curve (a kernel's fixed cost on the GPU): the small shapes' points
    would pull e_max above the peak with them; left out (``MIN_FIT_SECONDS``), the fit is the curve's."""
    shapes = SHAPES + [(256, 256, 256), (512, 512, 512), (4096, 256, 256), (1024, 1024, 256)]
    points = [{**p, "seconds": p["seconds"] + 4e-6} for p in _gemm(0.8, 60.0, shapes=shapes)]
    e, knee = fit_gemm(points, PEAK)
    assert e == pytest.approx(0.8, rel=0.03) and knee < 150, (e, knee)


@pytest.mark.parametrize("device, preset", [("NVIDIA H100 80GB HBM3", "8xH100-SXM"), ("NVIDIA H200", "8xH200-SXM"),
                                            ("NVIDIA A100-SXM4-80GB", "8xA100-80GB"), ("cpu (x86_64, 2 cores)",
                                                                                        "8xH200-SXM")])
def test_curves_are_fitted_against_the_preset_of_the_gpu_that_ran_them(device, preset):
    assert preset_for_device(device) == preset


@pytest.mark.parametrize("device", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB", "NVIDIA H200 NVL",
                                    "NVIDIA GH200 480GB"])
def test_a_gpu_whose_datasheet_no_preset_has_is_refused(device):
    with pytest.raises(ValueError, match="is not the GPU of the 8x.* preset .*own datasheet"):
        preset_for_device(device)


def test_curves_of_an_h100_give_h100s_hbm_efficiency_and_carry_over_to_the_h200():
    """The same copies timed on an H100 reach 0.9 of its 3.35 TB/s: fitted against the H200's 4.8 TB/s (the
    script's fit before it read the device) they would say 0.63. The H200 then gets the H100's efficiencies."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_curves
    finally:
        sys.path.remove(str(ROOT / "bench"))
    curves = _curves()
    big = 4 * 2 ** 30
    curves["device"] = "NVIDIA H100 80GB HBM3"
    curves["hbm"] = [{"op": op, "bytes": n * big, "seconds": n * big / (3.35e12 * 0.9), "gb_per_s": 3350 * 0.9}
                     for op, n in (("copy", 2), ("add", 3))]
    fit, rows = gpu_curves.summary(curves)
    assert fit["hbm_efficiency"] == pytest.approx(0.9) and fit["preset"].startswith("8xH100-SXM")
    assert fit["carried_over"]["preset"] == "8xH200-SXM"
    assert "carried over from 8xH100-SXM" in fit["carried_over"]["source"]
    h200 = h200_from_h100(measured_preset(HARDWARE["8xH100-SXM"], curves))
    assert h200.memory_bytes_per_s == 4.8e12 and h200.hbm_efficiency == pytest.approx(0.9)


def test_grouped_points_are_set_against_the_dense_price():
    [g] = grouped_vs_curve(_curves()["grouped"], H200)
    assert g["priced_s"] == pytest.approx(H200.gemm_seconds(1024, 1408, 2048, "bf16", 64))
    assert g["ratio"] == pytest.approx(1e-3 / g["priced_s"], rel=1e-3)


def test_load_curves_refuses_another_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_curves()))
    assert load_curves(str(path))["device"] == "NVIDIA H200"
    path.write_text(json.dumps({"device": "x", "gemm": []}))
    with pytest.raises(ValueError, match="no date, attention, hbm"):
        load_curves(str(path))


# ------------------------------------------------------------------ the scripts, on the CPU
def _run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def smoke_curves(tmp_path_factory):
    out = tmp_path_factory.mktemp("curves") / "gpu_curves_smoke.json"
    gpu_file = ROOT / "bench" / "results" / "gpu_curves.json"
    before = gpu_file.stat().st_mtime if gpu_file.exists() else None
    proc = _run("gpu_curves.py", "--cpu-smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (gpu_file.stat().st_mtime if gpu_file.exists() else None) == before  # never over the GPU's curves
    return out


def test_gpu_curves_cpu_smoke_writes_every_sweep(smoke_curves):
    out = smoke_curves
    data = json.loads(out.read_text())
    assert data["mode"] == "cpu-smoke" and data["benchmark"] == "gpu_curves"
    assert {"device", "date", "torch", "cuda", "clocks", "gemm", "attention", "hbm", "grouped", "launch", "program",
            "fit", "rows", "command", "when", "machine"} <= set(data)
    for key, fields in (("gemm", {"m", "n", "k", "seconds", "tflops"}),
                        ("attention", {"seq", "head_dim", "forward_seconds", "backward_seconds", "kernel"}),
                        ("hbm", {"op", "bytes", "seconds", "gb_per_s"}),
                        ("grouped", {"experts", "rows_per_expert", "d_model", "d_expert", "seconds"})):
        assert data[key] and all(fields <= set(p) for p in data[key]), (key, data[key])
    assert "Flash" in data["attention"][0]["kernel"]  # SDPA ran its flash kernel (the CPU's here)
    hw = measured_preset(H200, load_curves(str(out)))
    assert hw.sources["e_max"].startswith("measured on cpu")
    program = {p["family"]: p for p in data["program"]}
    assert {"gpt", "gpt-moe"} <= set(program) and program["gpt-moe"]["ops"] > program["gpt"]["ops"] > 100
    assert hw.family_op_seconds["gpt"] == program["gpt"]["seconds_per_op"] == hw.op_seconds


def test_gpu_estimate_check_cpu_smoke_prices_every_config_on_the_measured_preset(smoke_curves, tmp_path):
    out = tmp_path / "estimate.json"
    proc = _run("gpu_estimate_check.py", "--cpu-smoke", "--out", str(out), "--curves", str(smoke_curves),
                   timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "gpu_estimate_check" and len(data["rows"]) == 3
    assert all(r["ratio"] and r["ratio"] > 0 for r in data["rows"])
    assert "measured on cpu" in data["figures"]["preset"]
    assert {c["recompute"] for c in data["figures"]["configs"]} == {"none", "full"}
    # the activations the estimate counts against the meter's on the device: on CPU the count's own kernels
    assert all(abs(c["activations_ratio"] - 1) < 0.02 for c in data["figures"]["configs"]), \
        [c["activations_ratio"] for c in data["figures"]["configs"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("script", ["gpu_curves.py", "gpu_estimate_check.py"])
def test_without_cuda_or_cpu_smoke_they_exit_2(script):
    proc = _run(script)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "--cpu-smoke" in proc.stderr

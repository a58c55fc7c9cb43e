"""``bench/gpu_check.py`` on this machine: its CPU smoke mode passes every check with plausible figures,
its verdicts can say FAIL (parity against an untrained or shifted run, a check that raises), and without
CUDA or ``--cpu-smoke`` it exits 2 with a message saying what to run instead."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_smoke_passes_every_check_with_plausible_figures(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert list(checks) == ["launch", "torchrun", "gpt", "zero3_budget", "parity", "memory_history",
                            "offload_copies", "shared_gpu"]  # the shared-GPU worlds last (gpu_check.CHECKS)
    assert {c["status"] for c in checks.values()} == {"PASS"}, proc.stdout
    assert report["mode"] == "cpu-smoke" and report["passed"] is True
    for name, c in checks.items():  # one line per check, with its seconds
        assert f"PASS  {name}" in proc.stdout and c["seconds"] >= 0
    for key in ("launch", "torchrun"):  # the smoke asks for the rules both ways (ck.init's default is gloo)
        ranks = checks[key]["figures"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["backend"] == "nccl_rules" and r["sum"] == 3
                                                            for r in ranks)
    gpt = checks["gpt"]["figures"]
    assert 1_000 < gpt["parameters"] < 10_000 and all(math.isfinite(x) for x in gpt["losses"])
    assert gpt["losses"][-1] < gpt["losses"][0]
    assert gpt["throughput"]["tokens_per_s"] > 0 and 0 < gpt["throughput"]["mfu"] <= 1
    z = checks["zero3_budget"]["figures"]
    assert {"device", "host"} <= set(z["where"]) and z["account_peak"] <= z["budget"]
    assert all(math.isfinite(x) for x in z["losses"]) and all(math.isfinite(x) for x in z["bf16_offload_losses"])
    par = checks["parity"]["figures"]
    assert len(par["rows"]) == 16 and all(r["max_rel"] <= 1e-5 for r in par["rows"])
    assert "dp=2 zero=3" in par["skipped"] and "dp=1 zero=3 offload=auto" not in par["skipped"]
    assert "method='dispatch'" in checks["memory_history"]["figures"]["refused"]  # CPU: the allocator log refused
    shared = checks["shared_gpu"]["figures"]  # every multi-rank config, staged through host copies (smoke: on CPU)
    assert shared["env"] == {"COLAB_KIT_RULES_STAGE": "1"} and len(shared["rows"]) == 30
    assert all(r["staged"] and r["max_rel"] <= 1e-5 for r in shared["rows"])
    assert {r["config"] for r in shared["rows"]} >= {"dp=2 tp=4 tp_mode=2d zero=3", "dp=2 zero=3 offload=auto"}
    assert all(r["host_syncs"] is None for r in par["rows"])  # counted on CUDA only
    copies = checks["offload_copies"]["figures"]  # smoke: plain copies against lazy ones, the same losses
    modes = copies["modes"]
    assert {m["mode"] for m in modes.values()} == {"now", "lazy"} and copies["max_rel"] == 0.0
    assert modes["lazy"]["copies_per_step"]["to_host"] > 0 and modes["lazy"]["losses"] == modes["now"]["losses"]


def test_parity_reports_fail_for_an_untrained_run_and_for_shifted_losses(gpu_check):
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.models import GPTConfig
    from colab_kit.engine.reference import train_single_process

    cfg = GPTConfig(**gpu_check.PARITY_MODEL)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1)
    trained, _ = train_single_process(cfg, gpu_check.OPTIMIZERS["sgd"], data, 5, 8)
    untrained, _ = train_single_process(cfg, lambda ps: torch.optim.SGD(ps, lr=0.0), data, 5, 8)
    assert gpu_check.parity(trained, trained) == {"status": "PASS", "max_rel": 0.0}
    assert gpu_check.parity(untrained, trained)["status"] == "FAIL"
    assert gpu_check.parity([x * (1 + 3e-5) for x in trained], trained)["status"] == "FAIL"
    assert gpu_check.parity([x * (1 + 3e-6) for x in trained], trained)["status"] == "PASS"
    assert gpu_check.parity(trained[:-1], trained)["status"] == "FAIL"
    assert gpu_check.parity(trained[:-1] + [float("nan")], trained)["status"] == "FAIL"


def test_a_check_that_raises_or_fails_is_a_fail_and_the_others_still_run(gpu_check, capsys):
    def boom(ctx):
        raise RuntimeError("no device\nthe last line says why")

    res = gpu_check.run_checks([("boom", boom), ("bad", lambda ctx: (False, {"x": 1}, "figure off")),
                                ("good", lambda ctx: (True, {}, "fine"))], {})
    assert [r["status"] for r in res.values()] == ["FAIL", "FAIL", "PASS"]
    assert res["boom"]["detail"] == "raised RuntimeError: the last line says why"
    assert res["boom"]["figures"]["error"] == "no device\nthe last line says why"
    assert "Traceback" in res["boom"]["figures"]["traceback"]
    printed = capsys.readouterr().out.splitlines()
    assert [ln.split()[:2] for ln in printed] == [["FAIL", "boom"], ["FAIL", "bad"], ["PASS", "good"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_or_cpu_smoke_it_exits_2_and_says_what_to_run(tmp_path):
    out = tmp_path / "never.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr and "--cpu-smoke" in proc.stderr
    assert not out.exists()

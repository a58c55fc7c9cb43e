"""``colab_kit.observe.throughput``: the FLOPs formula against ``FlopCounterMode`` measuring a real forward and
backward (GPT at several shapes, BERT with padding, ViT, a Hugging Face GPT-2, a user's MLP), the cached
peak matmul measurement, and ``ck.throughput(engine)`` on a real dp=2 engine.

The reference counter is torch's ``FlopCounterMode`` with the CPU attention kernel given torch's own SDPA
formulas (``sdpa_flop_count`` / ``sdpa_backward_flop_count``, written out here apart from the module's
``flop_counter``): torch 2.13 registers them for the CUDA kernels only, so plain ``FlopCounterMode``
counts CPU attention as zero; a test checks that what it misses is exactly the formula's attention term.
"""
from __future__ import annotations

import json
import os
import statistics
import types
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils import flop_counter as fc

import colab_kit as ck
from colab_kit.observe import throughput
from colab_kit.models import BERT, GPT, BERTConfig, GPTConfig, ViT, ViTConfig
from colab_kit.observe.throughput import (
    engine_throughput,
    format_throughput,
    model_flops,
    peak_matmul,
    peak_matmul_flops,
)

GPT_CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)
BERT_CFG = BERTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
VIT_CFG = ViTConfig(image_size=8, patch_size=2, channels=3, num_classes=10, d_model=32, n_heads=4, n_layers=2)
TOL = 0.02

_aten = torch.ops.aten
CPU_SDPA = {  # torch's SDPA formulas for the CPU kernel, which torch 2.13 leaves unregistered
    _aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *a, out_shape=None, **kw: fc.sdpa_backward_flop_count(g, q, k, v),
}


def measured(model, x, training=True, mapping=CPU_SDPA) -> int:
    """FLOPs FlopCounterMode counts for one real forward (and backward) of ``model`` on ``x``."""
    model.train(training)
    with fc.FlopCounterMode(display=False, custom_mapping=mapping) as counter, torch.set_grad_enabled(training):
        out = model(x)
        out = out.logits if hasattr(out, "logits") else out
        if training:
            out.float().sum().backward()
    return counter.get_total_flops()


def read_json(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def close(a, b, tol=TOL) -> bool:
    return abs(a - b) <= tol * max(abs(b), 1)


def bert_ids(rows=4, t=16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 64, (rows, t), generator=g)
    ids[1, 10:] = 0  # padding: the masked attention path
    return ids


# --------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("shape", [(8, 32), (2, 16), (4, 7), (1, 32)])
def test_gpt_formula_matches_flop_counter(shape):
    model = GPT(GPT_CFG)
    x = torch.randint(0, 64, shape)
    assert close(model_flops(GPT_CFG, shape), measured(model, x))
    assert close(model_flops(model, shape, training=False), measured(model, x, training=False))


def test_worked_example():
    """The module docstring's numbers."""
    assert model_flops(GPT_CFG, (8, 32), training=False) == 52_428_800 + 4_194_304
    assert model_flops(GPT_CFG, (8, 32)) == 3 * 52_428_800 + 7 * 4_194_304 // 2 == 171_966_464


def test_bert_and_vit_formula_match_flop_counter():
    assert close(model_flops(BERT_CFG, (4, 16)), measured(BERT(BERT_CFG), bert_ids()))
    images = torch.randn(4, 3, 8, 8)
    vit = ViT(VIT_CFG)
    assert close(model_flops(VIT_CFG, (4, 3, 8, 8)), measured(vit, images))
    assert close(model_flops(vit, (4, 3, 8, 8), training=False), measured(vit, images, training=False))


def test_backward_is_counted():
    """A formula that forgot the backward, or counted it as 1x, would be off by 3x or 1.5x: the measured
    training step is 3x to 3.5x the forward (attention's fused backward recomputes its scores)."""
    for model, cfg, x in ((GPT(GPT_CFG), GPT_CFG, torch.randint(0, 64, (8, 32))),
                          (ViT(VIT_CFG), VIT_CFG, torch.randn(4, 3, 8, 8))):
        fwd, train = model_flops(cfg, tuple(x.shape), training=False), measured(model, x)
        assert 2.9 < train / fwd < 3.5
        assert not close(fwd, train, 0.5) and not close(2 * fwd, train, 0.2)


def test_plain_flop_counter_misses_exactly_cpu_attention():
    """Without the CPU kernel's formulas, FlopCounterMode counts the Linears alone: 3x their forward,
    which is the formula's total less its attention term (3.5 x 4 b t^2 h per layer)."""
    model, x = GPT(GPT_CFG), torch.randint(0, 64, (8, 32))
    plain = measured(model, x, mapping={})
    attention = GPT_CFG.n_layers * 14 * 8 * 32 ** 2 * GPT_CFG.d_model
    assert plain in (model_flops(GPT_CFG, (8, 32)), model_flops(GPT_CFG, (8, 32)) - attention)


def test_hf_gpt2_traced_matches_flop_counter():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=64)
    model = transformers.GPT2LMHeadModel(cfg)  # random weights from the config: no download
    x = torch.randint(0, 64, (2, 16))
    assert close(model_flops(model, (2, 16)), measured(model, x))  # dropout on: the math attention path
    assert close(model_flops(model, (2, 16), training=False), measured(model, x, training=False))
    meta = transformers.GPT2LMHeadModel(cfg).to("meta")  # what an engine keeps: engine.dense_twin
    assert model_flops(meta, (2, 16)) == model_flops(model, (2, 16))


def test_generic_module_matches_flop_counter():
    """A user's MLP on float inputs: its first Linear needs no input gradient (2x, not 3x)."""
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    x = torch.randn(16, 32)
    assert close(model_flops(mlp, (16, 32)), measured(mlp, x))
    assert model_flops(mlp, (16, 32), training=False) == 2 * 16 * (32 * 64 + 64 * 10)
    assert model_flops(mlp, (16, 32)) == 2 * 16 * (2 * 32 * 64 + 3 * 64 * 10)


def test_formula_refuses_wrong_inputs():
    with pytest.raises(ValueError, match="token ids"):
        model_flops(GPT_CFG, (4, 3, 8, 8))
    with pytest.raises(ValueError, match="images"):
        model_flops(VIT_CFG, (4, 16))
    with pytest.raises(TypeError):
        model_flops("gpt", (4, 16))


# --------------------------------------------------------------------------- the peak
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLAB_KIT_CACHE", str(tmp_path))
    monkeypatch.setattr(throughput, "_MEMO", {})
    return tmp_path


def test_peak_measured_once_and_cached(cache, monkeypatch):
    monkeypatch.setitem(throughput._BUDGET_S, "cpu", 0.0)  # the first shape alone (the budget: the test below)
    peak = peak_matmul_flops(threads=1)
    assert peak > 1e8
    files = [f for f in os.listdir(cache) if f.startswith("matmul-peak-")]
    assert len(files) == 1
    entry = read_json(cache / files[0])["cpu|float32|threads=1"]
    assert entry["flops_per_s"] == peak and len(entry["shape"]) == 3 and entry["threads"] == 1

    def never(*a):
        raise AssertionError("measured again")
    monkeypatch.setattr(throughput, "_measure", never)
    assert peak_matmul_flops(threads=1) == peak  # this process's memo
    monkeypatch.setattr(throughput, "_MEMO", {})
    assert peak_matmul_flops(threads=1) == peak  # the file, as a new process reads it


def test_peak_refresh_and_keys(cache, monkeypatch):
    calls = []

    def fake(device, dtype):
        calls.append((torch.get_num_threads(), dtype))
        return {"flops_per_s": 1e9 * len(calls), "shape": [8, 8, 8], "shapes_timed": 1, "seconds_to_measure": 0.0}
    monkeypatch.setattr(throughput, "_measure", fake)
    assert peak_matmul_flops(threads=1) == 1e9
    assert peak_matmul_flops(threads=1) == 1e9 and len(calls) == 1
    assert peak_matmul_flops(threads=1, refresh=True) == 2e9
    assert peak_matmul_flops(threads=1) == 2e9
    assert peak_matmul_flops(threads=2) == 3e9 and calls[-1][0] == 2  # measured with the threads asked for
    assert peak_matmul_flops(threads=1, dtype=torch.bfloat16) == 4e9 and calls[-1][1] == torch.bfloat16
    assert peak_matmul(threads=1)["shape"] == [8, 8, 8]
    assert len(calls) == 4


def test_the_budget_starts_no_shape_that_would_overrun_it(cache, monkeypatch):
    """The time budget decides which shapes are timed, not how fast this machine is: a budget of 0 times the
    first shape only (every later one would overrun it), an ample one times them all, the best rate wins."""
    shapes = [(128, 128, 128), (64, 64, 64), (96, 96, 96)]
    monkeypatch.setitem(throughput._SHAPES, "cpu", shapes)
    monkeypatch.setitem(throughput._BUDGET_S, "cpu", 0.0)
    entry = peak_matmul(threads=1, refresh=True)
    assert entry["shapes_timed"] == 1 and entry["shape"] == [128, 128, 128] and entry["flops_per_s"] > 0
    monkeypatch.setitem(throughput._BUDGET_S, "cpu", 1e9)
    entry = peak_matmul(threads=1, refresh=True)
    assert entry["shapes_timed"] == 3 and tuple(entry["shape"]) in shapes and entry["seconds_to_measure"] >= 0


# --------------------------------------------------------------------------- an engine
def test_throughput_errors():
    with pytest.raises(ValueError, match="no steps"):
        engine_throughput(types.SimpleNamespace(records=[]))
    with pytest.raises(ValueError, match="'seconds' or 'input_shape'"):
        engine_throughput(types.SimpleNamespace(records=[{"step": 1, "loss": 1.0}]))


def _train(cache_dir: str):
    warnings.filterwarnings("ignore")
    os.environ["COLAB_KIT_CACHE"] = cache_dir
    engine = ck.boost(GPT(GPT_CFG), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(dp=2))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 64, (8, 32), generator=g)
        engine.train_step((x, torch.roll(x, -1, 1)))
    d = ck.throughput(engine)

    def measured_again(*a, **k):
        raise AssertionError("ck.throughput(engine) measured the peak or counted the FLOPs again")
    throughput._measure = throughput.model_flops = measured_again  # this rank's process only
    again = ck.throughput(engine)  # from the memo and the engine's cache: nothing measured or traced
    out = {"d": d, "again": again, "last1": ck.throughput(engine, last=1), "records": engine.records,
           "line": format_throughput(d), "cached": dict(throughput._FLOPS.get(engine, {})),
           "threads": torch.get_num_threads()}
    engine.close()
    return out


def test_engine_throughput_dp2(tmp_path):
    results = ck.launch(_train, 2, str(tmp_path))
    for r in results:
        d = r["d"]
        for key in ("tokens_per_s", "samples_per_s", "flops_per_step", "step_seconds", "achieved_flops",
                    "flops_per_rank", "peak_flops", "mfu", "world_size", "steps"):
            assert key in d
        seconds = [rec["seconds"] for rec in r["records"]]
        assert d["steps"] == 2 and d["world_size"] == 2
        assert d["step_seconds"] == statistics.median(seconds[1:])  # the first step left out
        assert d["tokens_per_s"] == pytest.approx(8 * 32 / d["step_seconds"])
        assert d["samples_per_s"] == pytest.approx(8 / d["step_seconds"])
        assert d["flops_per_step"] == model_flops(GPT_CFG, (8, 32))  # the global batch's, not a rank's
        assert d["achieved_flops"] == pytest.approx(d["flops_per_step"] / d["step_seconds"])
        assert d["flops_per_rank"] == pytest.approx(d["achieved_flops"] / 2)
        assert d["mfu"] == pytest.approx(d["flops_per_rank"] / d["peak_flops"])
        assert 0 < d["mfu"] < 1
        assert r["last1"]["steps"] == 1 and r["last1"]["step_seconds"] == seconds[-1]
        assert r["again"] == d
        assert r["cached"] == {(8, 32): model_flops(GPT_CFG, (8, 32))}
        assert "tokens/s" in r["line"] and "MFU" in r["line"] and "measured peak" in r["line"]
    key = f"cpu|float32|threads={results[0]['threads']}"  # one rank's threads, not the kernel's
    files = [f for f in os.listdir(tmp_path) if f.startswith("matmul-peak-")]
    assert key in read_json(tmp_path / files[0])


def test_format_images():
    d = {"tokens_per_s": 1234.4, "samples_per_s": 38.6, "input_shape": (4, 3, 8, 8), "flops_per_step": 4.2e8,
         "mfu": 0.031, "peak_flops": 4.5e10}
    assert format_throughput(d) == ("1,234 tokens/s (38.6 samples/s) · 420 MFLOP/step · MFU 3.1% of 45 GFLOP/s "
                                    "measured peak")
    d.update(tokens_per_s=None, input_shape=(16, 32))
    assert format_throughput(d).startswith("38.6 samples/s · ")


def test_engine_throughput_images_and_other_models(cache, monkeypatch):
    """ViT: tokens are b * patches, samples/s beside them; a model without a built-in config is traced
    from the engine's meta copy, and float inputs are not tokens. Stub engines: records and fields only."""
    monkeypatch.setattr(throughput, "_measure", lambda device, dtype: {"flops_per_s": 1e11, "shape": [1, 1, 1],
                                                                        "shapes_timed": 1, "seconds_to_measure": 0})

    def stub(cfg, twin, shape, dtype, seconds=(0.5, 0.1, 0.3, 0.2)):
        recs = [{"step": i + 1, "loss": 1.0, "seconds": s, "input_shape": shape} for i, s in enumerate(seconds)]
        mesh = types.SimpleNamespace(device=torch.device("cpu"))
        step = types.SimpleNamespace(records=types.SimpleNamespace(input=(shape, dtype)))
        return types.SimpleNamespace(records=recs, model_cfg=cfg, dense_twin=twin, step=step,
                                     config=ck.ParallelConfig(dp=2), mesh=mesh)
    vit = stub(VIT_CFG, ViT(VIT_CFG, device="meta"), (4, 3, 8, 8), torch.float32)
    d = engine_throughput(vit)
    assert d["steps"] == 3 and d["step_seconds"] == 0.2 and d["tokens_per_step"] == 4 * 16
    assert d["tokens_per_s"] == pytest.approx(64 / 0.2) and d["samples_per_s"] == pytest.approx(4 / 0.2)
    assert d["flops_per_step"] == model_flops(VIT_CFG, (4, 3, 8, 8)) and d["peak_flops"] == 1e11
    assert "samples/s" in format_throughput(d)
    assert engine_throughput(vit, last=2)["step_seconds"] == pytest.approx(0.25)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    d = engine_throughput(stub(None, mlp.to("meta"), (16, 32), torch.float32))
    assert d["tokens_per_s"] is None and d["flops_per_step"] == 2 * 16 * (2 * 32 * 64 + 3 * 64 * 10)
    with pytest.raises(ValueError, match="positive"):
        engine_throughput(vit, last=0)

"""ActivationMeter (tier 1, one process): bytes saved for backward, parameters excluded, and
``measure(key)`` measuring each key once (the engine's hot path) with the same result."""
import torch

from colab_kit.memory import ActivationMeter
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)


def _forward(meter, model, rows, key=None):
    x = torch.zeros(rows, CFG.seq_len, dtype=torch.long)
    with meter.measure(key):
        out = model(x).sum()
    out.backward()
    return meter.last


def test_counts_saved_tensors_once_and_not_parameters():
    lin = torch.nn.Linear(4, 3, bias=False)
    meter = ActivationMeter(exclude=list(lin.parameters()))
    x = torch.randn(5, 4, requires_grad=True)
    with meter.measure():
        y = lin(x)            # saves x (80 B) and the weight (a parameter: not counted)
        z = (y * y).sum()     # saves y twice: one storage, 60 B
    z.backward()
    assert meter.last == meter.peak == 5 * 4 * 4 + 5 * 3 * 4


def test_keyed_measure_equals_a_fresh_measurement_and_is_reused():
    model = GPT(CFG)
    plain = ActivationMeter(exclude=list(model.parameters()))
    keyed = ActivationMeter(exclude=list(model.parameters()))
    two, four = _forward(plain, model, 2), _forward(plain, model, 4)
    assert 0 < two < four
    assert _forward(keyed, model, 2, key=2) == two     # first time: measured
    assert _forward(keyed, model, 4, key=4) == four
    assert _forward(keyed, model, 2, key=2) == two     # known key: reused
    keyed.reset()
    # the reused value is what the key measured, whatever runs inside (no hooks this time)
    assert _forward(keyed, model, 4, key=2) == two and keyed.peak == two
    keyed.forget()
    assert _forward(keyed, model, 4, key=2) == four    # forgotten: measured again


# --------------------------------------------------------------------------- the estimate
import pytest  # noqa: E402

import colab_kit as ck  # noqa: E402
from colab_kit.cli import MODEL  # noqa: E402
from colab_kit.datasets import SyntheticTokens  # noqa: E402
from colab_kit.engine.core import lm_loss  # noqa: E402
from colab_kit.memory import activation_bytes, estimate, model_state_bytes, optimizer_states  # noqa: E402
from colab_kit.recompute import recompute_blocks  # noqa: E402

PSI, N = 1_000_000, 4


def _total(optimizer, precision, zero, psi=PSI, n=N):
    return sum(model_state_bytes(psi, optimizer, precision, n, zero).values())


def test_zero_paper_formulas_fp32_adam():
    """16 Psi; stage 1: 8 Psi + 8 Psi/N; stage 2: 4 Psi + 12 Psi/N; stage 3: 16 Psi/N."""
    assert [_total("adamw", "fp32", z) for z in range(4)] == \
           [16 * PSI, 8 * PSI + 8 * PSI // N, 4 * PSI + 12 * PSI // N, 16 * PSI // N]
    assert model_state_bytes(PSI, "adamw", "fp32", N, 0) == {"params": 4 * PSI, "grads": 4 * PSI, "optimizer": 8 * PSI}
    assert model_state_bytes(PSI, "adamw", "fp32", N, 3) == {"params": PSI, "grads": PSI, "optimizer": 2 * PSI}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero_paper_formulas_mixed_precision(precision):
    """K = 12 (fp32 master, m, v): 2+2+12 Psi; 2+2+12/N; 2+14/N; 16/N."""
    assert [_total("adamw", precision, z) for z in range(4)] == \
           [16 * PSI, 4 * PSI + 12 * PSI // N, 2 * PSI + 14 * PSI // N, 16 * PSI // N]
    assert model_state_bytes(PSI, "adamw", precision, N, 1) == \
        {"params": 2 * PSI, "grads": 2 * PSI, "optimizer": 12 * PSI // N}


def test_sgd_has_its_own_k_and_shards_round_up():
    assert _total("sgd", "fp32", 0) == 12 * PSI and _total("sgd", "bf16", 0) == 2 * PSI + 2 * PSI + 8 * PSI
    assert _total("sgd-nomomentum", "fp32", 0) == 8 * PSI and _total("sgd-nomomentum", "bf16", 1) == 4 * PSI + PSI
    assert model_state_bytes(10, "adamw", "fp32", 4, 3) == {"params": 12, "grads": 12, "optimizer": 24}  # ceil(10/4)
    lin = torch.nn.Linear(2, 2)
    assert optimizer_states(torch.optim.AdamW(lin.parameters())) == 2
    assert optimizer_states(torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)) == 1
    assert optimizer_states(torch.optim.SGD(lin.parameters(), lr=0.1)) == 0
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_states("lion")


def test_estimate_keeps_its_old_call_and_adds_activations():
    assert estimate(1000, "adamw") == {"params": 4000, "grads": 4000, "optimizer": 8000, "activations": 0}
    assert estimate(PSI, "adamw", 4, N, 2) == dict(model_state_bytes(PSI, "adamw", "fp32", N, 2), activations=0)
    assert estimate(PSI, "adamw", 2, N, 2) == estimate(PSI, "adamw", dp=N, zero=2, precision="bf16")
    with pytest.raises(ValueError, match="not bytes_per_param=4"):
        estimate(PSI, "adamw", 4, precision="bf16")
    acts = estimate(PSI, model=CFG, rows=4, recompute=True)["activations"]
    assert acts == activation_bytes(CFG, 4, recompute=True)["held"] > 0


@pytest.mark.parametrize("cfg, rows", [
    (GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4), 8),
    (GPTConfig(vocab_size=128, seq_len=32, d_model=48, n_heads=6, n_layers=2, d_ff=96), 3),
])
@pytest.mark.parametrize("recompute", [False, True])
def test_activation_estimate_within_ten_percent_of_the_meter(cfg, rows, recompute):
    model = GPT(cfg)
    if recompute:
        recompute_blocks(model)
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=0).batch(0, rows)
    meter = ActivationMeter(exclude=list(model.parameters()))
    with meter.measure():
        loss = lm_loss(model(x), y)
    loss.backward()
    want = activation_bytes(cfg, rows, recompute=recompute)
    assert meter.last == pytest.approx(want["held"], rel=0.1), (meter.last, want)


def _demo_step(rows):
    cfg = GPTConfig(**MODEL)
    engine = ck.boost(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig())
    engine.train_step(SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=0).batch(0, rows))
    return engine.memory(), sum(p.numel() for p in engine.module.parameters())


def test_engine_memory_at_stage_0_is_the_estimate():
    """The demo GPT with AdamW on one rank after one step: params, grads, optimizer within 1%."""
    rows = 8
    measured, psi = ck.launch(_demo_step, 1, rows)[0]
    want = estimate(psi, "adamw", model=GPTConfig(**MODEL), rows=rows)
    for key in ("params", "grads", "optimizer"):
        assert measured[key] == pytest.approx(want[key], rel=0.01), key
    assert measured["activations"] == pytest.approx(want["activations"], rel=0.1)

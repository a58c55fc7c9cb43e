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

"""``offload="auto"`` at a cluster preset: placed under the preset's usable memory, priced for what it places.

The engine's auto placement (``colab_kit.zero.offload``) keeps ZeRO-3's chunks on the device while they fit beside
the step's activations and puts the rest on the host. ``ck.estimate`` at a preset places the states the same way
under ``Hardware.usable_bytes`` (``memory.formulas.auto_placed``) and prices the host update for the host's share
only, the rest as a device update (``terms.optimizer_seconds``), and the PCIe traffic of that share's chunks
(``terms.zero3_transfers``: staged per gather, counted as the engine counts them in
tests/ranks/test_zero3_transfers.py) where compute does not cover it. A model that fits
costs what it costs without offload; one that does not pays for its host share, less than ``offload="cpu"``.
"""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.models import GPTConfig
from colab_kit.planner.cluster.hardware import HARDWARE
from colab_kit.planner.cluster.price import price
from colab_kit.planner.cluster.terms import HOST_BYTES_PER_S, params_on_rank
from colab_kit.planner.estimate import memory_of
from colab_kit.planner.shape import ModelShape

HW = HARDWARE["8xH100-SXM"]
SMALL = GPTConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_heads=32, n_layers=32)   # 6.9B: fits
LARGE = GPTConfig(vocab_size=32000, seq_len=2048, d_model=8192, n_heads=64, n_layers=80)   # 65B: does not


def _estimates(cfg):
    return {off: ck.estimate(cfg, ck.ParallelConfig(dp=8, zero=3, offload=off, precision="bf16", recompute="full"),
                             8, hardware=HW) for off in ("none", "cpu", "auto")}


def test_auto_that_fits_costs_what_no_offload_costs():
    e = _estimates(SMALL)
    assert sum(e["auto"].memory["host"].values()) == 0
    assert e["auto"].memory == e["none"].memory and e["auto"].step_seconds == e["none"].step_seconds
    assert e["cpu"].step_seconds > 2 * e["none"].step_seconds  # the host's update, paid by "cpu" only
    assert any("0% of the model states on the host" in a for a in e["auto"].assumptions)


def test_auto_that_does_not_fit_puts_the_rest_on_the_host_and_pays_for_that_share():
    e = _estimates(LARGE)
    config = e["auto"].config
    dense = memory_of(ModelShape.of(LARGE), config, 8)  # the estimate before placement
    states = dense["params"] + dense["grads"] + dense["optimizer"]
    share = 1 - (HW.usable_bytes - dense["activations"]) / states  # by hand
    host = e["auto"].memory["host"]
    assert sum(host.values()) == pytest.approx(share * states, rel=1e-6) and 0.3 < share < 0.7
    assert sum(e["auto"].memory["device"].values()) == pytest.approx(HW.usable_bytes, rel=1e-6)  # full, not over
    params = params_on_rank(ModelShape.of(LARGE), config)
    shard = params / 8
    # the update: the host's share on the host, the rest on the device
    want = share * shard * 30 / HOST_BYTES_PER_S + HW.stream_seconds((1 - share) * shard * 30, 8)
    assert e["auto"].breakdown["optimizer"] == pytest.approx(want, rel=1e-6)
    # PCIe: the host chunks' shards staged per gather (twice, the tail once) and their reduced fp32 pieces back
    tail = 2 * 8192 + 32000 * 8192
    moved = price(ModelShape.of(LARGE), config, 8, HW, host_share=share).transfers
    assert moved["to_device"] == pytest.approx(share * 2 * (2 * params - tail) / 8, rel=1e-9)
    assert moved["to_host"] == pytest.approx(share * 4 * params / 8, rel=1e-9)
    assert e["auto"].breakdown["offload"] == max(0.0, moved["to_device"] / HW.pcie_bytes_per_s
                                                 - e["auto"].breakdown["compute"])
    assert e["none"].step_seconds < e["auto"].step_seconds < e["cpu"].step_seconds
    assert e["none"].device_bytes > HW.device_bytes >= e["auto"].device_bytes  # none does not fit

"""Offload's copies ordered as a GPU orders them (``colab_kit/zero/copies.py``), played on CPU ranks.

On a GPU the host -> device copy of a host chunk's shard and the device -> host copy of its gradient piece
run on a side stream: each lands only when it is waited, and its source may be read any time before that.
``COLAB_KIT_COPIES=lazy`` plays exactly that on CPU: a copy happens when it is waited (reading its source
then), its destination reads NaN until then. One spawn of 2 ranks trains ZeRO-3 with offload (all chunks on
the host, fp32 and bf16, two microbatches; and ``offload="auto"`` under a budget, chunks on both sides) with
plain copies and with lazy ones: the losses are the same bit for bit, and fp32's equal one process's. Two
broken programs show the mode catches what a GPU would get wrong, each running fine with plain copies: the
optimizer stepping before the gradient pieces landed (no ``drain``), and an all-gather reading a staged shard
it never waited for. A third, a host shard written between its copy and the drain (a GPU's copy could still be
reading it), trains with plain copies and is refused by lazy ones.
"""
from __future__ import annotations

import math

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.reference import train_single_process
from colab_kit.models import GPT, GPTConfig
from tests.helpers import STEPS

CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
CONFIGS = {
    "cpu fp32 mb=2": dict(dp=2, zero=3, offload="cpu", microbatches=2),
    "cpu bf16 mb=2": dict(dp=2, zero=3, offload="cpu", microbatches=2, precision="bf16"),
    "auto fp32": dict(dp=2, zero=3, offload="auto", recompute=True),
}
OPT = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731


def _losses(kw: dict, budget: int | None = None) -> tuple[list[float], dict]:
    data = SyntheticTokens(64, 16, seed=1)
    engine = ck.boost(GPT(GPTConfig(**CFG)), OPT, ck.ParallelConfig(**kw), device_budget=budget)
    losses = [engine.train_step(data.batch(s, 8)) for s in range(STEPS)]
    place = engine.data_parallel.placement
    out = dict(where=list(place.where), counts=dict(place.copies.counts), mode=place.copies.mode)
    engine.close()
    return losses, out


def _run(_) -> dict:
    import os

    from colab_kit.zero import offload
    out: dict = {}
    budget = None
    for mode in ("now", "lazy"):
        os.environ["COLAB_KIT_COPIES"] = mode
        for name, kw in CONFIGS.items():
            if kw["offload"] == "auto" and budget is None:  # below the model states: some chunks stay on the host
                probe = ck.boost(GPT(GPTConfig(**CFG)), OPT, ck.ParallelConfig(**kw), device_budget=1 << 40)
                probe.train_step(SyntheticTokens(64, 16, seed=1).batch(0, 8))
                budget = int(0.9 * sum(probe.memory()[k] for k in ("params", "grads", "optimizer")))
                probe.close()
            out[mode, name] = _losses(kw, budget if kw["offload"] == "auto" else None)
    # broken on purpose: each is fine with plain copies, and wrong where copies land late
    drain, staged = offload.ChunkPlacement.drain, offload.ChunkPlacement.staged

    def no_drain(self):  # the optimizer steps on gradients still in flight
        self.ahead = {}

    def unwaited(self, i):  # the all-gather reads the copy's destination before the copy landed
        if self.where[i] != "host":
            return self.chunks[i].shard.detach()
        self.ahead.pop(i, None)
        return self.copies.to_device(self.chunks[i].shard.detach()).out

    def early_write(self):  # a host shard written (an optimizer step, say) before the copies were drained
        host = [c for c, w in zip(self.chunks, self.where) if w == "host"]
        host[-1].shard.data.mul_(1.0 + 2.0 ** -5)
        drain(self)

    for mode in ("now", "lazy"):
        os.environ["COLAB_KIT_COPIES"] = mode
        offload.ChunkPlacement.drain = early_write
        try:
            _losses(CONFIGS["cpu fp32 mb=2"])
            out["early write", mode] = "trained"
        except RuntimeError as exc:
            out["early write", mode] = str(exc)
        finally:
            offload.ChunkPlacement.drain = drain
    for what, patch in (("drain", no_drain), ("staged", unwaited)):
        setattr(offload.ChunkPlacement, what, patch)
        try:
            for mode in ("now", "lazy"):
                os.environ["COLAB_KIT_COPIES"] = mode
                out["broken", what, mode] = _losses(CONFIGS["cpu fp32 mb=2"])[0]
        finally:
            offload.ChunkPlacement.drain, offload.ChunkPlacement.staged = drain, staged
    os.environ.pop("COLAB_KIT_COPIES")
    return out


@pytest.fixture(scope="module")
def results():
    return ck.launch(_run, 2, None)


def test_lazy_copies_train_as_plain_ones_and_as_one_process(results):
    ref, _ = train_single_process(GPTConfig(**CFG), OPT, SyntheticTokens(64, 16, seed=1), STEPS, 8)
    for rank, res in enumerate(results):
        for name in CONFIGS:
            (now, now_info), (lazy, lazy_info) = res["now", name], res["lazy", name]
            assert lazy_info["mode"] == "lazy" and now_info["mode"] == "now", (rank, name)
            assert lazy == now, (rank, name, now, lazy)  # the same program, its copies landing later
            assert lazy_info["counts"] == now_info["counts"] and lazy_info["counts"]["to_host"] > 0, (rank, name)
            if "fp32" in name:
                assert lazy == pytest.approx(ref, rel=1e-5), (rank, name)
        where = res["lazy", "auto fp32"][1]["where"]
        assert "host" in where and "device" in where, where  # chunks on both sides


def test_lazy_copies_catch_a_missing_wait(results):
    ref, _ = train_single_process(GPTConfig(**CFG), OPT, SyntheticTokens(64, 16, seed=1), STEPS, 8)
    for rank, res in enumerate(results):
        for what in ("drain", "staged"):
            plain, lazy = res["broken", what, "now"], res["broken", what, "lazy"]
            assert plain == pytest.approx(ref, rel=1e-5), (rank, what)  # plain copies forgive it
            assert any(math.isnan(x) for x in lazy) or lazy != pytest.approx(ref, rel=1e-3), (rank, what, lazy)
        # a shard changed after its copy was made, before the drain: plain copies cannot tell; lazy ones refuse
        assert res["early write", "now"] == "trained", res["early write", "now"]
        assert "changed before the copies were drained" in res["early write", "lazy"], res["early write", "lazy"]

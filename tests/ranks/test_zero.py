"""ZeRO stages 1 and 2 against one process: three GPT steps (AdamW and SGD + momentum) give the
single-process losses (1e-5 relative) and final parameters, for zero=1 and 2 at dp=2 (zero=1 and 2 with
offload="cpu" too: the optimizer and its fp32 copies on the host), zero=2 at
dp=4 with microbatches, with tp=2 (1d), with pp=2 (1f1b) and with a 2D tensor mode (8 ranks); the
optimizer states per rank are the dense states / dp (plus padding); the collectives per step are
one reduce-scatter of the gradients (stage 2 without pp: one per microbatch) and one all-gather of
the parameters per bucket, together the wire bytes of one all-reduce (per microbatch's reduction);
a parameter that gets no gradient neither stalls nor corrupts a step; inside a stage-2 step a
rank's gradients stay under its pieces plus two buckets (measured with StatePeak).
One spawn per world size, configurations looped inside."""
from __future__ import annotations

import warnings

import pytest
import torch

import colab_kit as ck
from colab_kit.comm import wire_bytes
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory import model_state_bytes
from colab_kit.memory.peak import StatePeak, state_bytes
from colab_kit.models import GPT
from colab_kit.zero import check_optimizer

from tests.helpers import (BATCH, GPT_CFG, OPTIMIZERS, STEPS, gpt_reference as reference, named_params as _named,
                           same_over_dp as _same_over_dp, with_unused as _with_unused)

STATES = {"adamw": 2, "sgd": 1}  # fp32 state tensors per parameter element
WORLD2 = [dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=1, offload="cpu"), dict(dp=2, zero=2, microbatches=4),
          dict(dp=2, zero=2, offload="cpu", microbatches=2)]  # stage 2's fp32 masters path, reduced per microbatch
WORLD4 = [dict(dp=4, zero=2, microbatches=2), dict(dp=2, tp=2, zero=2),
          dict(dp=2, pp=2, zero=2, microbatches=2, schedule="1f1b"), dict(dp=2, pp=2, zero=1, microbatches=2)]
WORLD8 = [dict(dp=2, tp=4, tp_mode="2d", zero=2)]  # zero=3 with 2d: tests/ranks/test_zero3.py


# --------------------------------------------------------------------------- on each rank
def _train(cfgs, extras: bool = False):
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for kw in cfgs:
        for opt in OPTIMIZERS:
            engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
            losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
            z, records = engine.data_parallel, engine.comm(last_step=True)  # before the checks' own collectives
            out[tuple(sorted(kw.items())), opt] = dict(
                losses=losses, params=_named(engine, kw), memory=engine.memory(),
                comm=records, kinds={e["kind"] for e in engine.timeline()},
                local=sum(p.numel() for p in engine.module.parameters()), sizes=list(z.sizes),
                shard=sum(s.numel() for s in z.shards), buckets=len(z.buckets),
                same=_same_over_dp(engine))
            engine.close()
    if extras:
        out["unused"] = _unused(data)
        out["refused"] = _refused()
        out["peak"] = _peak(data)
    return out


def _unused(data):
    """zero=1 with the default buckets, zero=2 with one bucket per tensor (the unused one alone)."""
    out = {}
    for zero, bucket_bytes in ((1, None), (2, 1)):
        for opt in OPTIMIZERS:
            engine = ck.boost(_with_unused(), OPTIMIZERS[opt], ck.ParallelConfig(dp=2, zero=zero),
                              bucket_bytes=bucket_bytes)
            losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            out[zero, opt] = dict(losses=losses, params=params, buckets=len(engine.data_parallel.buckets),
                                  grad_records=sum(r["tag"].startswith("grad") for r in engine.comm(last_step=True)))
            engine.close()
    return out


def _refused():
    """An optimizer built over other tensors than the pieces it is given is refused on every rank."""
    try:
        ck.boost(GPT(GPT_CFG), lambda ps: torch.optim.SGD(GPT(GPT_CFG).parameters(), lr=0.1),
                 ck.ParallelConfig(dp=2, zero=1))
    except ck.ConfigError as exc:
        return str(exc)
    return None


def _peak(data):
    """zero=2, buckets of about 1/8 of the gradients, microbatches 1 and 2: one step under StatePeak
    (the meter bench/zero.py applies to FSDP2 alike), after a warm-up step."""
    out, grads_total = {}, 4 * sum(p.numel() for p in GPT(GPT_CFG).parameters())
    for m in (1, 2):
        engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS["adamw"], ck.ParallelConfig(dp=2, zero=2, microbatches=m),
                          bucket_bytes=grads_total // 8)
        losses = [engine.train_step(data.batch(0, BATCH))]
        roots = (engine.module, engine.optimizer, engine.data_parallel)
        before = state_bytes(*roots)
        with StatePeak(*roots) as meter:
            losses.append(engine.train_step(data.batch(1, BATCH)))
        z = engine.data_parallel
        out[m] = dict(losses=losses, peak=meter.peak, at_peak=meter.at_peak, before=before, after=state_bytes(*roots),
                      memory=engine.memory(), own=getattr(z, "peak_nbytes", None),  # None before stage 2 counted it
                      pieces=4 * sum(s.numel() for s in z.shards), buckets=[4 * s for s in z.sizes],
                      largest_param=max(4 * p.numel() for p in engine.module.parameters()),
                      local=sum(p.numel() for p in engine.module.parameters()))
        engine.close()
    return out


@pytest.fixture(scope="module")
def world2():
    return ck.launch(_train, 2, WORLD2, True)


# --------------------------------------------------------------------------- checks
def _check_parity(results, cfgs):
    for kw in cfgs:
        key = tuple(sorted(kw.items()))
        for opt in OPTIMIZERS:
            ref_losses, ref_params = reference(opt)
            owned = set()
            for rank, res in enumerate(results):
                got = res[key, opt]
                assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (kw, opt, rank)
                assert got["same"], (kw, opt, rank)
                atol = 2e-4 if opt == "adamw" else 5e-5  # as the dp and pipeline tests (Adam at noise level)
                for name, p in got["params"].items():
                    torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=atol,
                                               msg=lambda m: f"{kw} {opt} rank {rank} {name}: {m}")
                    owned.add(name)
                assert "comm" in got["kinds"] and got["kinds"] <= {"compute", "comm", "idle"}, (kw, opt, rank)
            assert owned == set(ref_params), (kw, opt)  # pp: the stages together hold the whole model


def _check_memory(results, cfgs):
    """Optimizer states = dense states / dp (+ padding); grads: stage 1 whole, stage 2 the pieces."""
    for kw in cfgs:
        key, dp = tuple(sorted(kw.items())), kw["dp"]
        for opt in OPTIMIZERS:
            for rank, res in enumerate(results):
                got = res[key, opt]
                mem, padded = got["memory"], sum(got["sizes"])
                assert got["shard"] * dp == padded and padded - got["local"] < dp * got["buckets"], (kw, rank)
                counters = 4 * got["buckets"] if opt == "adamw" else 0  # Adam's step count, one per tensor
                offload = kw.get("offload", "none")
                masters = 4 * got["shard"] if offload == "cpu" else 0  # ZeRO-Offload: the host's fp32 copies
                dense = STATES[opt] * 4 * got["local"]
                assert mem["optimizer"] == STATES[opt] * 4 * got["shard"] + counters + masters, (kw, opt, rank)
                assert dense / dp <= mem["optimizer"] - counters - masters < dense / dp + STATES[opt] * 4 * got["buckets"]
                if offload == "cpu":  # the optimizer, states and copies, on the host; the rest on the device
                    assert mem["host"] == {"params": 0, "grads": 0, "optimizer": mem["optimizer"], "activations": 0}
                assert mem["params"] == 4 * padded
                assert mem["grads"] == (4 * padded if kw["zero"] == 1 else 4 * got["shard"]), (kw, opt, rank)
                # the one estimator (the ZeRO paper's formulas) agrees with the measurement within 5%
                est = model_state_bytes(got["local"], opt, "fp32", dp=dp, zero=kw["zero"], offload=offload)
                for part in ("params", "grads", "optimizer"):
                    assert abs(est[part] - mem[part]) <= 0.05 * mem[part], (kw, opt, rank, part, est, mem)


def _check_comm(results, cfgs):
    """Per step: per bucket one reduce-scatter (whole bucket) and one all-gather (this rank's piece);
    stage 2 without pp reduces every microbatch (colab_kit.zero.stage2): m reduce-scatters per bucket."""
    for kw in cfgs:
        key, dp = tuple(sorted(kw.items())), kw["dp"]
        m = kw.get("microbatches", 1) if kw["zero"] == 2 and kw.get("pp", 1) == 1 else 1
        for res in results:
            got = res[key, "adamw"]
            dp_records = [r for r in got["comm"] if r["axis"] == "dp"]
            rs = [r for r in dp_records if r["op"] == "reduce_scatter"]
            ag = [r for r in dp_records if r["op"] == "all_gather"]
            assert len(rs) == m * got["buckets"] and len(ag) == got["buckets"], kw
            assert [r["tag"] for r in dp_records if r not in rs + ag] == ["loss"], kw
            assert sorted(r["bytes"] for r in rs) == sorted(4 * s for s in got["sizes"] for _ in range(m))
            assert sorted(r["bytes"] * dp for r in ag) == sorted(4 * s for s in got["sizes"])
            padded = 4 * sum(got["sizes"])
            rs_wire, ag_wire = sum(r["wire"] for r in rs), sum(r["wire"] for r in ag)
            assert rs_wire == m * wire_bytes("reduce_scatter", padded, dp), kw  # per microbatch: an all-reduce's
            assert rs_wire // m + ag_wire == wire_bytes("all_reduce", padded, dp), kw  # half, the gather the other


def test_zero_dp2_parity_memory_comm_unused(world2):
    _check_parity(world2, WORLD2)
    _check_memory(world2, WORLD2)
    _check_comm(world2, WORLD2)


def test_a_parameter_without_gradient_neither_stalls_nor_corrupts(world2):
    init = {n: p.detach() for n, p in _with_unused().named_parameters() if n.startswith("unused")}
    for res in world2:
        for (zero, opt), got in res["unused"].items():
            ref_losses, ref_params = reference(opt)
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (zero, opt)
            atol = 2e-4 if opt == "adamw" else 5e-5
            for name, p in ref_params.items():
                torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=atol)
            # its gradient was exactly zero: SGD leaves it alone, AdamW only decays it (lr 3e-3, wd 0.01)
            decay = (1 - 3e-3 * 0.01) ** STEPS if opt == "adamw" else 1.0
            for name, p in init.items():
                torch.testing.assert_close(got["params"][name], p * decay, rtol=1e-6, atol=0)
            if zero == 2:  # one bucket per tensor: the unused weight and bias are buckets of their own
                assert got["buckets"] == len(ref_params) + 2 and got["grad_records"] == got["buckets"]


def test_an_optimizer_over_other_tensors_is_refused(world2):
    assert all("over exactly the tensors it is given" in res["refused"] for res in world2)


def test_stage2_peak_gradients_stay_under_pieces_plus_two_buckets(world2):
    """Inside a step, per rank (fp32): peak grads <= pieces (4 Psi / N, padded) + 2 x the largest bucket
    + the largest parameter's gradient. Two buckets: one being reduce-scattered, one filling
    (colab_kit.zero.stage2); one gradient: autograd's fresh tensor while it is copied into its bucket.
    Before stage 2 freed its buckets a rank held 4 Psi + 4 Psi / N of gradients through backward."""
    ref = reference("adamw")[0][:2]
    for rank, res in enumerate(world2):
        for m, got in res["peak"].items():
            assert got["losses"] == pytest.approx(ref, rel=1e-5), (m, rank)
            grads_peak = got["peak"] - got["before"]["params"] - got["before"]["optimizer"]  # those stay put
            two = sum(sorted(got["buckets"])[-2:])
            whole = 4 * got["local"]
            assert len(got["buckets"]) >= 6 and two < whole / 2, got["buckets"]
            assert grads_peak <= got["pieces"] + two + got["largest_param"], (m, rank, grads_peak, got["at_peak"])
            # the rank's own count of its full buckets is what the meter saw (up to one fresh gradient)
            assert got["own"] <= grads_peak <= got["own"] + got["largest_param"], (m, rank, got["own"], grads_peak)
            # after the step: only the pieces, as the formula says
            assert got["after"]["grads"] == got["memory"]["grads"] == got["pieces"], (m, rank)
            est = model_state_bytes(got["local"], "adamw", "fp32", dp=2, zero=2)
            for part in ("params", "grads", "optimizer"):
                assert abs(est[part] - got["memory"][part]) <= 0.05 * got["memory"][part], (m, rank, part)



def test_zero_with_microbatches_tp_and_pp():
    results = ck.launch(_train, 4, WORLD4)
    _check_parity(results, WORLD4)
    _check_memory(results, WORLD4)
    _check_comm(results, WORLD4)


def test_zero_with_2d_tensor_parallelism_on_8_ranks():
    results = ck.launch(_train, 8, WORLD8, timeout=300)
    _check_parity(results, WORLD8)
    _check_memory(results, WORLD8)


def test_stage_3_with_pp_and_whole_parameter_optimizers_are_refused():
    with pytest.raises(ck.ConfigError, match=r"ZeRO stage 3 with pipeline parallelism .*zero=2 with pp"):
        ck.boost(GPT(GPT_CFG), OPTIMIZERS["sgd"], ck.ParallelConfig(dp=2, pp=2, zero=3))
    t = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ck.ConfigError, match="LBFGS needs whole parameters"):
        check_optimizer(torch.optim.LBFGS(t))

    class Lamb(torch.optim.Optimizer):  # stands for any optimizer outside torch's elementwise ones
        def __init__(self, params):
            super().__init__(params, {})

    with pytest.raises(ck.ConfigError, match="Lamb is not known to be elementwise.*LAMB, LARS.*elementwise\\(Lamb\\)"):
        check_optimizer(Lamb(t))
    from colab_kit.zero.optimizer import ELEMENTWISE, elementwise
    try:  # declared elementwise by its author, it is taken
        elementwise(Lamb)
        check_optimizer(Lamb(t))
    finally:
        ELEMENTWISE.discard(Lamb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for make in OPTIMIZERS.values():
            check_optimizer(make(t))

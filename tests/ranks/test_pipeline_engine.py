"""Pipeline engine against one process: every schedule (gpipe, 1f1b, interleaved, zb-h1, zb-v, which
re-plans from its measured costs after step 2) for
pp=2, pp=4, pp=2 x dp=2 and pp=2 x tp=2 trains to the single-process losses; a stepped step
equals an unstepped one bit for bit; at pp=2 a rank's measured step peak stays flat from 4 to 64
microbatches, within each schedule's bound (``tests/helpers/pipeline_memory.py``); a stuck rank gives
every rank's position within the timeout. One spawn per world size, configurations looped inside."""
from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.core import lm_loss
from colab_kit.engine.reference import train_single_process
from colab_kit.models import GPT, GPTConfig
from colab_kit.pipeline import PipelinePlan, build_plan, build_plan_for, lower, simulate
from colab_kit.pipeline.costs import shorter_plan
from colab_kit.pipeline.hang import PipelineHang
from colab_kit.pipeline.stage import check_stages, split_model, stage_layers

from tests.helpers import OPTIMIZERS
from tests.helpers.pipeline_memory import PEAK_CASES, check_peaks, measure_peaks

GPT4 = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
STEPS, BATCH, M = 3, 8, 4
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def configs(**base) -> list[dict]:
    return [dict(base, microbatches=M, schedule=s, chunks=2 if s in ("interleaved", "zb-v") else 1)
            for s in SCHEDULES]


def with_optimizers(cfgs: list[dict], alternate: bool = False) -> list[tuple[dict, str]]:
    """(config, optimizer) pairs: each config with both optimizers, or (``alternate``) config i with optimizer
    i % 2. Over ``configs()`` lists of five schedules laid end to end, that gives each schedule both in turn."""
    names = list(OPTIMIZERS)
    return [(kw, opt) for i, kw in enumerate(cfgs) for opt in ((names[i % 2],) if alternate else names)]


def model_cfg(kw: dict) -> GPTConfig:
    """4 blocks, or one per stage where pp * chunks is larger (pp=4 interleaved or zb-v: 8 stages)."""
    return dataclasses.replace(GPT4, n_layers=max(4, kw["pp"] * kw["chunks"]))


@functools.lru_cache(maxsize=None)
def reference(n_layers: int, opt: str):
    data = SyntheticTokens(64, 16, seed=1)
    losses, model = train_single_process(dataclasses.replace(GPT4, n_layers=n_layers), OPTIMIZERS[opt], data,
                                         STEPS, BATCH)
    with torch.no_grad():
        losses.append(lm_loss(model(data.batch(STEPS, BATCH)[0]), data.batch(STEPS, BATCH)[1]).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- on each rank
def _train(pairs):
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for kw, opt in pairs:
        engine = ck.boost(GPT(model_cfg(kw)), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
        pipe, losses, fitted = engine.pipeline, [], None
        for s in range(STEPS):
            losses.append(engine.train_step(data.batch(s, BATCH)))
            if s == 1 and kw["schedule"] == "zb-v":  # the rest of the steps run the V fitted to its costs
                fitted = pipe.replan()
        mine = pipe.plan.actions[pipe.me]
        params = {}
        if kw.get("tp", 1) == 1:
            params = {n: p.detach().clone() for st in engine.module
                      for n, p in zip(st.source_names, st.parameters())}
        out[tuple(sorted(kw.items())), opt] = dict(
            losses=losses, params=params, plan=[str(a) for a in mine],
            actions=[e["action"] for e in engine.timeline() if "action" in e],
            kinds={e["kind"] for e in engine.timeline()},
            p2p=[(r["op"], r["axis"], r["tag"], r["bytes"]) for r in engine.comm(last_step=True)
                 if r["axis"] == "pp" and r["op"] in ("send", "recv")],
            memory=engine.memory(), fitted=fitted)
        out[tuple(sorted(kw.items())), opt]["losses"].append(engine.evaluate(data.batch(STEPS, BATCH)))
    return out


def _stepping(cfgs):
    """Per config: two engines, one stepped a timestep at a time: losses and parameters bit for bit."""
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for kw in cfgs:
        cfg = ck.ParallelConfig(**kw)
        plain = ck.boost(GPT(model_cfg(kw)), OPTIMIZERS["sgd"], cfg)
        stepped = ck.boost(GPT(model_cfg(kw)), OPTIMIZERS["sgd"], cfg)
        pipe, states, losses = stepped.pipeline, [], []
        for step in range(2):
            batch = data.batch(step, BATCH)
            losses.append((plain.train_step(batch), None))
            stepped.step.begin(batch)
            if step == 0:
                while pipe.timestep < pipe.n_timesteps:
                    states.append(stepped.step.advance(1))
            else:  # jump halfway, then one at a time, then the rest
                states.append(stepped.step.advance_to(pipe.n_timesteps // 2))
                states.append(stepped.step.advance())
            losses[-1] = (losses[-1][0], stepped.step.finish())
        out[tuple(sorted(kw.items()))] = dict(
            losses=losses, same_params=torch.equal(ck.state_vector(plain), ck.state_vector(stepped)),
            executed=[len(s["executed"]) for s in states[:pipe.n_timesteps]],
            expected=[sum(t < k + 1 for t in pipe.timesteps[pipe.me]) for k in range(pipe.n_timesteps)],
            held=max(len(s["held"]) for s in states[:pipe.n_timesteps]), last=states[pipe.n_timesteps - 1],
            timeline_kinds={e["kind"] for e in stepped.timeline()})
    return out


def _train_and_step(train_cfgs, step_cfgs, peak_cases=()):
    return _train(train_cfgs), _stepping(step_cfgs), measure_peaks(peak_cases)


# --------------------------------------------------------------------------- parity
def _check_training(results, pairs):
    for kw, opt in pairs:
        key = tuple(sorted(kw.items()))
        ref_losses, ref_params = reference(model_cfg(kw).n_layers, opt)
        owned = {}
        for rank, res in enumerate(results):
            got = res[key, opt]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (kw, opt, rank)
            assert got["losses"] == results[0][key, opt]["losses"], (kw, opt, rank)  # equal on all ranks
            # AdamW divides each gradient by its own running size, so an element whose gradient
            # sits at fp32 rounding noise (summed per microbatch here, over the batch there) can
            # move by a fraction of lr either way: a looser atol for it; SGD keeps the tight one
            atol = 2e-4 if opt == "adamw" else 5e-5
            for name, p in got["params"].items():
                torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=atol,
                                           msg=lambda m: f"{kw} {opt} {name} {m}")
                owned[name] = p
            # every action ran once, in plan order, and was timed
            assert got["actions"] == got["plan"], (kw, opt, rank)
            assert got["kinds"] <= {"compute", "comm", "idle"} and "comm" in got["kinds"]
            # one recorded p2p per send/receive action after the first step (no shape header any more)
            comm_actions = [a for a in got["plan"] if any(k in a for k in ("SF", "RF", "SB", "RB"))]
            assert sorted(t for _, _, t, _ in got["p2p"]) == sorted(comm_actions)
            rows = BATCH // kw.get("dp", 1) // M
            assert {b for *_, b in got["p2p"]} == {rows * 16 * 32 * 4}
            if kw["schedule"] == "zb-v":  # replan(): every stage's F, I, W measured, the same on every rank
                n = kw["pp"] * 2
                assert sorted(got["fitted"]) == sorted((s, k) for s in range(n) for k in "FIW")
                assert got["fitted"] == results[0][key, opt]["fitted"] and min(got["fitted"].values()) >= 0
                want = shorter_plan(build_plan("zb-v", kw["pp"], M, 2, costs=got["fitted"]),
                                    build_plan_for(ck.ParallelConfig(**kw), model_cfg(kw)), got["fitted"])
                assert got["plan"] == [str(a) for a in lower(want)
                                       .actions[rank // (kw.get("dp", 1) * kw.get("tp", 1))]]
        if kw.get("tp", 1) == 1:  # the stages together hold the whole model
            assert set(owned) == set(ref_params), (kw, opt)


def _check_stepping(stepped, cfgs):
    for kw in cfgs:
        key = tuple(sorted(kw.items()))
        for rank, res in enumerate(stepped):
            got = res[key]
            assert all(a == b for a, b in got["losses"]), (kw, rank, got["losses"])  # bitwise
            assert got["same_params"], (kw, rank)
            assert got["executed"] == got["expected"], (kw, rank)
            assert got["last"]["next"] is None and got["last"]["held"] == []
            assert "idle" in got["timeline_kinds"]  # the pauses between advance() calls
            pp_rank = rank // (kw.get("dp", 1) * kw.get("tp", 1))
            plan = lower(build_plan_for(ck.ParallelConfig(**kw), model_cfg(kw)))  # the engine's (zb-v: on the FLOPs)
            assert got["held"] == simulate(plan).peak_held[pp_rank], (kw, rank)


def test_pp2_every_schedule_matches_single_process_and_steps():
    cfgs = configs(pp=2)
    results = ck.launch(_train_and_step, 2, with_optimizers(cfgs), cfgs, PEAK_CASES)
    _check_training([r[0] for r in results], with_optimizers(cfgs))
    _check_stepping([r[1] for r in results], cfgs)
    # a send's tensor goes when the send completes: 1F1B's peak at 64 microbatches within one microbatch's
    # activations of its peak at 4; ZB-V and interleaved flat too, and within their bounds in microbatches
    print("step peaks (bytes) by rank and schedule:", check_peaks([r[2] for r in results], PEAK_CASES))
    # GPipe keeps every microbatch's activations on rank 0, 1F1B at most pp of them
    mem = {s: results[0][0][tuple(sorted(kw.items())), "sgd"]["memory"]["activations"]
           for s, kw in zip(SCHEDULES, cfgs)}
    assert mem["1f1b"] < 0.6 * mem["gpipe"], mem


def test_pp4_and_pp2_with_dp_and_tp_match_single_process():
    """Every schedule under each layout, with one optimizer each (both per schedule over the three layouts;
    pp=2 above runs every schedule with both)."""
    cfgs = with_optimizers(configs(pp=4) + configs(pp=2, dp=2) + configs(pp=2, tp=2), alternate=True)
    assert all({o for kw, o in cfgs if kw["schedule"] == s} == set(OPTIMIZERS) for s in SCHEDULES)
    step = dict(zip(SCHEDULES, range(len(SCHEDULES))))
    step_cfgs = ([configs(pp=4)[step["interleaved"]], configs(pp=4)[step["zb-v"]],
                  configs(pp=2, dp=2)[step["zb-h1"]], configs(pp=2, tp=2)[step["1f1b"]]])
    results = ck.launch(_train_and_step, 4, cfgs, step_cfgs)
    _check_training([r[0] for r in results], cfgs)
    _check_stepping([r[1] for r in results], step_cfgs)


# --------------------------------------------------------------------------- hangs
def _stuck(fault: str, timeout: float):
    """Rank 0 loses its send 0SF1 ('lost send'), or rank 1 sleeps in 1F1 ('sleep') or fails in it ('error')."""
    import torch.distributed as dist

    from colab_kit.pipeline import PlanError

    rank, data = dist.get_rank(), SyntheticTokens(64, 16, seed=1)
    engine = ck.boost(GPT(GPT4), OPTIMIZERS["sgd"], ck.ParallelConfig(pp=2, microbatches=2, schedule="gpipe"))
    pipe = engine.pipeline
    pipe.timeout = timeout
    engine.train_step(data.batch(0, BATCH))  # a good step first
    broken = PipelinePlan.parse("rank 0: 0F0 0SF0 0F1 0RB0 0B0 0RB1 0B1\n"
                        "rank 1: 1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1", "gpipe")
    try:
        pipe.plan = broken
        refused = None
    except PlanError as exc:  # a plan missing a send is refused on every rank before it runs
        refused = str(exc)
    if fault == "lost send" and rank == 0:  # its turn in the message order passes, nothing goes out
        send = pipe._send
        pipe._send = lambda a, *args: None if str(a) == "0SF1" else send(a, *args)
    if fault == "sleep" and rank == 1:
        forward = pipe._do_F
        pipe._do_F = lambda a, s, m: (_asleep_until_reported(pipe.monitor, SLEEP * timeout) if m == 1 else None,
                                      forward(a, s, m))
    if fault == "error" and rank == 1:
        forward = pipe._do_F
        pipe._do_F = lambda a, s, m: forward(a, s, m) if m == 0 else 1 / 0
    t = time.perf_counter()
    try:
        engine.train_step(data.batch(1, BATCH))
    except PipelineHang as exc:
        return dict(message=str(exc), seconds=time.perf_counter() - t, reports=exc.reports, refused=refused)
    except ZeroDivisionError as exc:  # the failing rank gets its own error back
        return dict(message=repr(exc), seconds=time.perf_counter() - t, refused=refused)
    return dict(message=None, seconds=time.perf_counter() - t, refused=refused)


SLEEP = 8  # timeouts the 'sleep' fault's rank sleeps at most: it must still be asleep when the report reaches it


def _asleep_until_reported(monitor, limit: float) -> None:
    """The 'sleep' fault: asleep in 1F1 until this rank's monitor has published its report (what it answers
    the waiting rank: "running 1F1") and the waiting rank has gathered it, ``limit`` seconds at most; then on to
    1B0, where the flag stops it and this rank publishes its report again ("stopped before 1B0"). The waiting
    rank gathers for ``report_wait`` seconds from raising the flag, which was before this rank's report went
    out, so asleep that long after it, this rank never replaces its report while the other still reads
    (it did once, under CI's load, when it woke as soon as the report was out)."""
    key = monitor._key(monitor._step, f"report/{monitor.rank}")
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with monitor._lock:
            if monitor.flagged.is_set() and monitor.store.check([key]):
                time.sleep(min(monitor.report_wait, max(end - time.monotonic(), 0)))
                return
        time.sleep(0.05)
REPORTED = 6  # timeouts within which the waiting rank reports: the timeout and every rank's answer, on a loaded machine


@pytest.mark.parametrize("fault", ["lost send", "sleep", "error"])
def test_stuck_rank_reports_every_rank_within_the_timeout(fault):
    timeout = 1.0
    results = ck.launch(_stuck, 2, fault, timeout, timeout=60)
    for rank, res in enumerate(results):
        assert "0SF1" in res["refused"], res["refused"]
        assert res["message"] is not None, f"rank {rank} did not report a hang"
    first = results[1] if fault == "lost send" else results[0]  # the rank that waits on the other
    assert first["seconds"] < REPORTED * timeout, first["seconds"]  # at the timeout, not at the launch's 60 s
    msg = first["message"]
    assert "step | rank 0" in msg and set(first["reports"]) == {0, 1}, msg
    for line in ("rank 0 (pp 0 dp 0 tp 0):", "rank 1 (pp 1 dp 0 tp 0):"):
        assert line in msg, msg
    if fault == "lost send":
        assert "waited" in msg and "1RF1" in msg and "[1RF1]" in msg, msg
        assert "[0RB0]" in msg, msg  # rank 0 in its grid column: waiting for a gradient that never comes
        # under nccl_rules each rank's report lists what it issued and is not complete
        assert "issued, not complete: group of ranks [0, 1]: recv float32[4, 16, 32] from rank 0 (running" in msg, msg
    elif fault == "sleep":
        assert "waited" in msg and "0RB0" in msg and "[0RB0]" in msg, msg
        assert "running 1F1" in msg and "[1F1]" in msg, msg  # the sleeping rank answered from its monitor
        assert "stopped before 1B0 because rank 0 reported: rank 0 (pp 0) waited" in results[1]["message"]
        assert "stopped before 1B0, on another rank" in results[1]["message"]
    else:
        assert results[1]["message"].startswith("ZeroDivisionError"), results[1]["message"]
        assert "[0RB0]" in msg and "rank 1 (pp 1 dp 0 tp 0): failed in 1F1: ZeroDivisionError" in msg, msg


# --------------------------------------------------------------------------- no processes
def test_layers_that_do_not_split_over_stages_are_refused_before_any_process():
    with pytest.raises(ck.ConfigError, match=r"n_layers=4 does not split evenly over pp\*chunks = 4\*2 = 8"):
        ck.boost(GPT(GPT4), OPTIMIZERS["sgd"], ck.ParallelConfig(pp=4, schedule="interleaved", chunks=2,
                                                                 microbatches=4))
    with pytest.raises(ck.ConfigError, match="n_layers=3 .* = 2 pipeline stages: use n_layers a multiple of 2"):
        check_stages(3, ck.ParallelConfig(pp=2))
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_split_model_gives_each_rank_its_stages_of_the_placement():
    gpt = GPT(dataclasses.replace(GPT4, n_layers=8))
    v = ck.ParallelConfig(pp=4, schedule="zb-v", chunks=2, microbatches=4)
    loop = v.replace(schedule="interleaved")
    assert [[st.index for st in split_model(gpt, v, r)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [[st.index for st in split_model(gpt, loop, r)] for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    first, last = split_model(gpt, v, 0)  # under the V rank 0 holds the embeddings and the head
    assert first.first and last.last and list(last.layers) == [7]
    assert "embeddings" in repr(first) and "ln_f, head" in repr(last)

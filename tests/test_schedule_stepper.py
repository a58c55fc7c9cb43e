"""ScheduleStepper: walking a plan (tier 1), the widgets headless, a real engine on the session cluster (tier 3)."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.pipeline import build_plan, lower, steps
from colab_kit.viz.schedule_data import held_series
from colab_kit.widgets import ScheduleStepper
from colab_kit.widgets.schedule_stepper import StepperError


def _prefix(plan, t):
    """Per pipeline rank, the actions the lockstep grid runs before timestep t."""
    rows = steps(plan)
    return {r: [str(row[r]) for row in rows[:t] if row[r] is not None] for r in range(plan.pp)}


@pytest.mark.parametrize("shape", [("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1), ("interleaved", 2, 4, 2)],
                         ids=lambda s: s[0])
def test_walking_a_plan_step_by_step(shape):
    plan = lower(build_plan(*shape))
    s = ScheduleStepper(build_plan(*shape))
    assert s.state.n_timesteps == len(steps(plan)) and not s.state.running and s.state.step == 0
    assert repr(s).endswith("plan only (no engine ran these actions): step 0, not started)")
    planned = held_series(plan)
    t = 0
    for k in (1, 3, 7):
        st = s.step(k)
        t += k
        assert st.running and st.timestep == t and st.step == 1
        prefix = _prefix(plan, t)
        assert {r: x["executed"] for r, x in st.ranks.items()} == prefix
        assert st.current == {r: (str(plan.actions[r][len(p)]) if len(p) < len(plan.actions[r]) else None)
                              for r, p in prefix.items()}
        assert [st.held[r][-1] for r in range(plan.pp)] == [(t, planned[r][1][t]) for r in range(plan.pp)]
    text = repr(st)
    assert f"step 1, timestep {t} of {st.n_timesteps}" in text and "[" in text
    assert f"pp rank 0 (rank 0): ran {len(prefix[0])} of {len(plan.actions[0])} actions" in text
    st = s.play()
    assert st.finished and not st.running and st.timestep == st.n_timesteps and st.loss is None
    assert st.executed == {str(a) for row in plan.actions for a in row} and st.current == {}
    assert [st.held[r][-1][1] for r in range(plan.pp)] == [0] * plan.pp
    st = s.reset()
    assert not st.running and not st.finished and st.ranks == {} and "not started" in repr(st)
    assert s.step().step == 2


def test_figures_follow_the_state():
    s = ScheduleStepper(build_plan("1f1b", 2, 4))
    assert {t.meta for t in s.figure().data} == {"planned"}
    s.step(4)
    metas = {}
    for t in s.figure().data:
        for label in t.text:
            metas[label] = t.meta
    assert {k for k, v in metas.items() if v == "executed"} == s.state.executed
    assert {k for k, v in metas.items() if v == "current"} == {a for a in s.state.current.values() if a}
    names = [t.name for t in s.memory_figure().data]
    assert names == ["rank 0 (planned)", "rank 1 (planned)", "rank 0 (measured)", "rank 1 (measured)"]


def test_widgets_headless():
    s = ScheduleStepper(build_plan("gpipe", 2, 2), k=2)
    box = s.widget()
    ui = s._ui
    assert box is s.widget() and ui["k"].value == 2 and ui["k"].max == s.state.n_timesteps
    assert "not started" in ui["status"].value and ui["loss"].value == ""
    ui["Step"].click()
    assert s.state.timestep == 2 and "timestep 2 of" in ui["status"].value
    assert {t.meta for t in ui["grid"].data} >= {"executed", "planned, not run yet"}
    ui["k"].value = 3
    ui["Step"].click()
    assert s.state.timestep == 5
    ui["Play"].click()
    assert s.state.finished and "finished" in ui["status"].value
    ui["Reset"].click()
    assert "not started" in ui["status"].value and {t.meta for t in ui["grid"].data} == {"planned"}


def test_without_a_cluster_it_says_what_to_do():
    with pytest.raises(StepperError, match="no cluster to step"):
        ScheduleStepper(None, None)


# ------------------------------------------------------------------ against the real engine
def _build(name, words, layers):
    import torch

    import colab_kit as ck
    from colab_kit.models import GPT, GPTConfig
    from colab_kit.cluster.remote import namespace

    cfg = ck.ParallelConfig.parse(words)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=layers))
    namespace()[name] = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), cfg)
    return True


def _train_step(name, batch):
    from colab_kit.cluster.remote import namespace

    return namespace()[name].train_step(batch)


def _timeline(name):
    from colab_kit.cluster.remote import namespace

    return namespace()[name].timeline()


@pytest.mark.parametrize("words", ["pp=4 microbatches=8", "pp=4 microbatches=8 schedule=interleaved chunks=2",
                                   "pp=2 dp=2 microbatches=4 schedule=zb-h1"])
def test_stepping_the_real_engine(cluster, words):
    from colab_kit.datasets import SyntheticTokens

    cfg = ck.ParallelConfig.parse(words)
    data = SyntheticTokens(64, 16, seed=0)
    cluster.run(_build, "stepped", words, 8)
    cluster.run(_build, "plain", words, 8)
    s = ScheduleStepper(cluster, lambda i: data.batch(i, 16), var="stepped")
    plan = s.state.plan
    assert plan.lowered and (plan.schedule, plan.pp, plan.chunks) == (cfg.schedule, cfg.pp, cfg.chunks)
    assert s.state.source == "engine on 4 ranks"
    planned = held_series(plan)
    for t in (5, 17):
        st = s.step(t - s.state.timestep)
        assert st.running and st.timestep == t
        assert {r: x["rank"] for r, x in st.ranks.items()} == {r: r * cfg.dp for r in range(cfg.pp)}  # dp 0's
        # the ranks report exactly the plan's prefix: nothing is filled in from the plan
        assert {r: x["executed"] for r, x in st.ranks.items()} == _prefix(plan, t)
        assert [st.held[r][-1] for r in range(cfg.pp)] == [(t, planned[r][1][t]) for r in range(cfg.pp)]
        assert all(x["held_bytes"] > 0 for x in st.ranks.values() if x["held"])
    st = s.play(delay=0)
    assert st.finished and st.executed == {str(a) for row in plan.actions for a in row}
    assert len(st.peak_bytes) == cfg.pp and all(b > 0 for b in st.peak_bytes)
    reference = cluster.run(_train_step, "plain", data.batch(0, 16))
    assert st.loss == pytest.approx(reference[0], rel=1e-6) and st.losses == [st.loss]
    events = cluster.run(_timeline, "stepped")
    assert {e["action"] for evs in events for e in evs if "action" in e} == st.executed
    assert any(e["name"] == "paused" and e["kind"] == "idle" for e in events[0])
    s.step(3)
    st = s.reset()  # finishes the step under way on the ranks: the second loss is recorded
    assert not st.running and len(st.losses) == 2
    assert cluster.run(_train_step, "plain", data.batch(1, 16))[0] == pytest.approx(st.losses[1], rel=1e-6)


def test_a_rank_without_the_engine_is_named(cluster):
    cluster.set_config(ck.ParallelConfig(pp=4, microbatches=4))
    with pytest.raises(StepperError, match="rank 0 has no variable 'no_such_engine': build the pipeline engine"):
        ScheduleStepper(cluster, None, var="no_such_engine")


def test_outside_a_kernel_it_prints_text(capsys):
    s = ScheduleStepper(build_plan("1f1b", 2, 2))
    s.step(3)
    s._ipython_display_()
    out = capsys.readouterr().out
    assert out.startswith("ScheduleStepper(1f1b pp=2 microbatches=2, plan only") and "timestep 3 of" in out

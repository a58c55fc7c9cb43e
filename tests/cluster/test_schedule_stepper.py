"""ScheduleStepper: walking a plan (tier 1), the widgets headless, a real engine on the session cluster (tier 3)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import colab_kit as ck
from colab_kit.pipeline import build_plan, lower, steps
from colab_kit.viz.schedule_data import held_series
from colab_kit.notebook.widgets import ScheduleStepper, display
from colab_kit.notebook.widgets.schedule_stepper import StepperError


def _prefix(plan, t):
    """Per pipeline rank, the actions the lockstep grid runs before timestep t."""
    rows = steps(plan)
    return {r: [str(row[r]) for row in rows[:t] if row[r] is not None] for r in range(plan.pp)}


@pytest.mark.parametrize("shape", [("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1), ("interleaved", 2, 4, 2),
                                   ("zb-v", 4, 8, 2)], ids=lambda s: s[0])
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


# ------------------------------------------------------------------ the buttons never block the kernel
BUTTONS = ("Step", "Play", "Reset", "Pause")


def _watched(s, fail_at=None):
    """Patch ``s.step`` to record, at each call, the buttons' disabled flags, the loop's tick and the thread."""
    seen, step = [], s.step

    def patched(*args, **kwargs):
        seen.append(({b: s._ui[b].disabled for b in BUTTONS}, ticks[0], threading.current_thread()))
        if len(seen) == fail_at:
            raise RuntimeError("rank 1 lost its peer\nsecond line")
        return step(*args, **kwargs)

    ticks = [0]
    s.step = patched
    return seen, ticks


async def _ticking(ticks, until):
    """A coroutine on the same loop, as the kernel's message handling is: counts its turns."""
    while not until():
        ticks[0] += 1
        await asyncio.sleep(0)


def test_play_runs_as_a_task_and_the_loop_runs_between_steps():
    s = ScheduleStepper(build_plan("1f1b", 2, 4), k=1)
    s.widget()
    seen, ticks = _watched(s)

    async def kernel():
        s._ui["Play"].click()
        task = s._task
        assert isinstance(task, asyncio.Task) and not task.done() and s.state.step == 0  # control came back
        assert s.busy and [s._ui[b].disabled for b in BUTTONS] == [True, True, True, False]
        await asyncio.gather(task, _ticking(ticks, task.done))

    asyncio.run(kernel())
    st = s.state
    assert st.finished and len(seen) == st.n_timesteps  # k=1: one call per timestep
    assert all(t is not threading.main_thread() for _, _, t in seen)  # each step ran off the loop's thread
    assert all(a[1] < b[1] for a, b in zip(seen, seen[1:]))  # the loop ran between every two steps
    assert all(d == {"Step": True, "Play": True, "Reset": True, "Pause": False} for d, _, _ in seen)
    assert not s.busy and [s._ui[b].disabled for b in BUTTONS] == [False, False, False, True]
    assert "finished" in s._ui["status"].value


def test_pause_stops_play_after_the_step_under_way():
    s = ScheduleStepper(build_plan("gpipe", 2, 4), k=1)
    s.widget()
    seen, ticks = _watched(s)
    paused_at = []

    async def kernel():
        task = s.play_in_background()
        while len(seen) < 3:
            await asyncio.sleep(0)
        s._ui["Pause"].click()  # while step 3 runs or right after it
        paused_at.append(len(seen))
        await task

    asyncio.run(kernel())
    st = s.state
    assert len(seen) == paused_at[0] == 3 and st.running and st.timestep == 3 and not st.finished
    assert [s._ui[b].disabled for b in BUTTONS] == [False, False, False, True]
    assert s.play_in_background() is s.state and st.finished  # no loop: plays synchronously to the end


def test_buttons_are_disabled_during_a_step_and_errors_are_shown():
    s = ScheduleStepper(build_plan("1f1b", 2, 4), k=2)
    s.widget()
    seen, ticks = _watched(s, fail_at=3)
    s._ui["Step"].click()  # no running loop: done at once, synchronously
    assert seen[0][0] == {"Step": True, "Play": True, "Reset": True, "Pause": True}
    assert seen[0][2] is threading.current_thread() and s.state.timestep == 2
    assert [s._ui[b].disabled for b in BUTTONS] == [False, False, False, True]
    s._ui["Step"].click()
    s._ui["Step"].click()  # the third call fails: shown in the widget, not raised, buttons enabled again
    assert s.error == "RuntimeError: rank 1 lost its peer\nsecond line" and s.state.timestep == 4
    assert [o["text"] for o in s._ui["errors"].outputs] == [s.error + "\n"]
    assert "#b00020" in s._ui["status"].value and "lost its peer" in s._ui["status"].value
    assert [s._ui[b].disabled for b in BUTTONS] == [False, False, False, True]

    s._ui["Step"].click()  # a new click clears the last error
    assert s.error is None and s._ui["errors"].outputs == () and s.state.timestep == 6


def test_an_error_while_playing_in_a_task_is_shown_and_the_buttons_come_back():
    s = ScheduleStepper(build_plan("1f1b", 2, 4), k=1)
    s.widget()
    seen, ticks = _watched(s, fail_at=2)

    async def kernel():
        task = s.play_in_background()
        with pytest.raises(RuntimeError, match="lost its peer"):  # whoever awaits the task sees it too
            await task

    asyncio.run(kernel())
    assert len(seen) == 2 and s.state.timestep == 1 and s.state.running and not s.busy
    assert s.error.startswith("RuntimeError: rank 1 lost its peer") and "lost its peer" in s._ui["status"].value
    assert [o["text"] for o in s._ui["errors"].outputs] == [s.error + "\n"]
    assert [s._ui[b].disabled for b in BUTTONS] == [False, False, False, True]


def test_text_plain_is_the_grid_not_the_widget_repr(monkeypatch):
    s = ScheduleStepper(build_plan("1f1b", 2, 4))
    s.step(3)
    text = repr(s)
    assert "timestep 3 of" in text and "[" in text  # the grid, each rank's next action in brackets
    assert s._repr_mimebundle_() == {"text/plain": text}  # outside a kernel: the text form only
    monkeypatch.setattr(display, "in_kernel", lambda: True)
    bundle = s._repr_mimebundle_()
    assert bundle["text/plain"] == text and not text.startswith("VBox")
    assert bundle[display.WIDGET_MIME]["model_id"] == s.widget().model_id


def test_in_a_real_kernel_a_cell_runs_while_it_plays():
    """ipykernel: the Play click a frontend sends (a comm message) returns at once, the kernel runs a cell
    while the stepper plays, and a Pause click stops it after the step under way."""
    from jupyter_client.manager import start_new_kernel

    n_timesteps = ScheduleStepper(build_plan("1f1b", 2, 8)).state.n_timesteps
    km, kc = start_new_kernel(kernel_name="python3")
    out = []

    def cell(code):
        out.clear()
        reply = kc.execute_interactive(code, timeout=60, output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out).split()

    def poll(code, done, seconds=30):  # a cell now and then (never a sleeping cell: it would hold the loop)
        deadline = time.monotonic() + seconds
        while not done(got := cell(code)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def click(button):
        comm_id = cell(f"print(s._ui[{button!r}].model_id)")[0]
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
            "method": "custom", "content": {"event": "click"}}}))

    try:
        cell("import time; from colab_kit.pipeline import build_plan; from colab_kit.notebook.widgets import ScheduleStepper\n"
             "s = ScheduleStepper(build_plan('1f1b', 2, 8)); s.widget(); step = s.step\n"
             "s.step = lambda *a, **k: (time.sleep(0.2), step(*a, **k))[1]  # a call to the ranks takes a while")
        click("Play")
        busy, timestep, disabled = poll("print(s.busy, s.state.timestep, s._ui['Play'].disabled)",
                                        lambda got: int(got[1]) > 0)
        assert (busy, disabled) == ("True", "True") and 0 < int(timestep) < n_timesteps
        click("Pause")
        assert poll("print(s.busy, s.state.running, s.state.finished)", lambda got: got[0] == "False") == \
            ["False", "True", "False"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_without_a_cluster_it_says_what_to_do():
    with pytest.raises(StepperError, match="no cluster to step"):
        ScheduleStepper(None, None)


# ------------------------------------------------------------------ against the real engine
def _build(name, words, layers):
    import torch

    import colab_kit as ck
    from colab_kit.models import GPT, GPTConfig
    from colab_kit.notebook.cluster.remote import namespace

    cfg = ck.ParallelConfig.parse(words)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=layers))
    namespace()[name] = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), cfg)
    return True


def _train_step(name, batch):
    from colab_kit.notebook.cluster.remote import namespace

    return namespace()[name].train_step(batch)


def _timeline(name):
    from colab_kit.notebook.cluster.remote import namespace

    return namespace()[name].timeline()


@pytest.mark.parametrize("words", ["pp=4 microbatches=8", "pp=4 microbatches=8 schedule=interleaved chunks=2",
                                   "pp=2 dp=2 microbatches=4 schedule=zb-h1",
                                   "pp=4 microbatches=8 schedule=zb-v chunks=2"])
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

    async def kernel():  # Play as its button runs it in a kernel: each call to the ranks from a worker thread
        task = s.play_in_background(delay=0)
        assert not task.done() and s.busy
        return await task

    st = asyncio.run(kernel())
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

"""``ScheduleStepper``: step a real pipeline training step on the cluster, timestep by timestep.

    stepper = ck.widgets.ScheduleStepper(cluster, lambda step: data.batch(step, 16))
    stepper            # buttons Step / Play / Pause / Reset, timesteps per click, the plan's grid,
                       # activations held per rank, the loss once the step finished
    stepper.step(10)   # the same from code: every rank runs its actions of timesteps 0..9

Every rank's namespace must hold the engine (``engine = ck.boost(...)`` with pp > 1; another
name with ``var=``). ``step(k)`` calls ``engine.step.advance_to(t + k)`` on every rank
through ``cluster.run``, so all ranks advance together (a receive waits for a send of an
earlier timestep, which its peer runs in the same call), then reads ``state()`` back: what
each rank executed, its next action, the activations it holds. The grid fills in with what
the ranks report, never with what the plan predicts. At the last timestep the stepper
calls ``finish()`` (gradients, optimizer step) and shows the loss; the next ``step()``
begins a new training step on the next batch. ``reset()`` first finishes a step that is
under way (its messages are already in flight: the ranks cannot drop half a step), then
shows the grid empty again.

Given a ``PipelinePlan`` instead of a cluster, the stepper walks the plan's lockstep grid without
any engine (labelled "plan only"), which is how the plan itself can be read step by step.

The buttons never block the kernel: a click starts a task on the kernel's event loop that
awaits each call to the ranks in a worker thread, so the kernel keeps handling messages.
Step / Play / Reset are disabled while the ranks work, Pause stops Play after the step under
way, and an error is shown in the widget's output area. From code::

    task = stepper.play_in_background()   # in a kernel: returns at once (an asyncio.Task)
    stepper.pause()                       # ... which stops after the step under way
    stepper.play()                        # synchronous: returns when the step has finished

Without a running event loop (plain Python, a script) the buttons and ``play_in_background()``
run synchronously. While it plays, leave the cluster to the stepper (or Pause first).
"""
from __future__ import annotations

import asyncio
import time
import traceback
from typing import Any

from .display import KernelDisplay, html, keep_quiet, off_loop, running_loop
from ..session import find
from .figure_view import figure_view, redraw
from .stepper_state import StepperError, StepperState, _rank_advance, _rank_begin, _rank_finish, _rank_probe
from ...errors import RankError
from ...pipeline import lower, steps
from ...viz.pipeline import activation_memory_figure, schedule_figure

__all__ = ["ScheduleStepper", "StepperState", "StepperError"]


# ------------------------------------------------------------------ the stepper
class ScheduleStepper(KernelDisplay):
    """Step a pipeline training step on every rank and watch the plan's grid fill in.

    source: a ``Cluster`` whose ranks hold a pp > 1 engine in ``var`` (None: the
        ``%colossal`` cluster), or a ``PipelinePlan`` to walk without an engine.
    batch: the global batch ``(inputs, targets)``, or a function ``step -> batch``
        (called in the kernel with 0, 1, ... for each training step begun).
    k: timesteps per ``step()`` (the slider's start value).
    delay: while playing, the widgets redraw at most this often (seconds); redrawing the
        grid costs a few tenths of a second, stepping the ranks a few hundredths.
    """

    def __init__(self, source=None, batch=None, *, var: str = "engine", k: int = 1, delay: float = 0.5):
        self.var, self.batch, self.k, self.delay = var, batch, max(1, int(k)), delay
        self.cluster: Any = None  # a Cluster (or what runs like one), None for a plan alone
        self._ui: dict[str, Any] | None = None  # the widgets, once built
        self.busy, self._pause = False, False
        self.error: str | None = None
        self._task: asyncio.Task | None = None
        if hasattr(source, "actions") and hasattr(source, "pp"):
            plan, what, states = lower(source), "plan only (no engine ran these actions)", None
        else:
            self.cluster = source if source is not None else _magic_cluster()
            plan, states = self._probe()
            what = f"engine on {self.cluster.world_size} ranks"
        self.state = StepperState(plan, steps(plan), what)
        if states is not None and any(s["running"] for s in states):  # adopt a step begun elsewhere
            self._take(states)
            self.state.running, self.state.step = True, states[0]["step"]

    # ------------------------------------------------------------ logic (no widgets)
    def step(self, k: int | None = None, *, redraw: bool = True) -> StepperState:
        """Advance every rank ``k`` timesteps (beginning a training step first if none runs)."""
        st = self.state
        if not st.running:
            self._begin()
        self._advance(min(st.timestep + (k or self.k), st.n_timesteps))
        if st.timestep >= st.n_timesteps:
            self._finish()
        if redraw:
            self._redraw()
        return st

    def play(self, delay: float | None = None) -> StepperState:
        """Step until the training step has finished and return; the widgets redraw at most every ``delay`` s."""
        self._pause = False
        for unit in self._work(lambda: self.step(redraw=False), True, delay):
            unit()
        self._redraw()
        return self.state

    def play_in_background(self, delay: float | None = None):
        """Play as a task on the running event loop (the kernel's) and return it at once; ``pause()`` stops it.

        Without a running loop this is ``play()``: it returns the state when the step has finished.
        """
        if running_loop() is None:
            return self.play(delay)
        return self._start(lambda: self.step(redraw=False), repeat=True, delay=delay)

    def pause(self) -> None:
        """Stop a background Play after the step under way (the ranks stay where they are: Play resumes)."""
        self._pause = True

    def reset(self, *, redraw: bool = True) -> StepperState:
        """Finish a step under way (the ranks cannot drop half a step), then show the grid empty."""
        st = self.state
        if st.running:
            self._finish()
        st.running, st.finished, st.timestep, st.ranks, st.held = False, False, 0, {}, {}
        if redraw:
            self._redraw()
        return st

    def figure(self):
        """The plan's grid: executed actions solid, the rest pale, each rank's next action outlined."""
        st = self.state
        if not st.ranks:
            return schedule_figure(st.plan)
        return schedule_figure(st.plan, executed=st.executed, current=st.current)

    def memory_figure(self):
        """Activations each rank holds: planned lines, the ranks' reports as markers."""
        return activation_memory_figure(self.state.plan, measured=self.state.held or None)

    # ------------------------------------------------------------ driving the ranks (or walking the plan)
    def _probe(self):
        try:
            got = self.cluster.run(_rank_probe, self.var)
        except RankError as exc:
            raise StepperError(f"could not read the pipeline of the ranks: {str(exc).splitlines()[0]}") from None
        bad = [(r, g) for r, g in enumerate(got) if isinstance(g, str)]
        if bad:
            r, why = bad[0]
            raise StepperError(f"rank {r} has {why}: build the pipeline engine on every rank first, e.g. in a "
                               f"%%colossal cell: {self.var} = ck.boost(model, optimizer_factory, config) "
                               "with a config of pp > 1")
        return got[0][0], [g[1] for g in got]

    def _run(self, fn, *args):
        return self.cluster.run(fn, self.var, *args)

    def _begin(self) -> None:
        st = self.state
        st.running, st.finished, st.loss, st.timestep, st.step = True, False, None, 0, st.step + 1
        st.held = {r: [(0, 0)] for r in range(st.plan.pp)}
        if self.cluster is None:
            self._take(st.walk(0))
            return
        batch = self.batch(st.step - 1) if callable(self.batch) else self.batch
        if batch is None:
            st.running, st.step = False, st.step - 1
            raise StepperError("no batch to train on: ScheduleStepper(cluster, batch) takes the global batch "
                               "(inputs, targets) or a function step -> batch")
        self._take(self._run(_rank_begin, batch))

    def _advance(self, timestep: int) -> None:
        st = self.state
        self._take(st.walk(timestep) if self.cluster is None else self._run(_rank_advance, timestep))
        st.timestep = timestep
        for r, s in st.ranks.items():
            st.held.setdefault(r, []).append((timestep, len(s["held"])))

    def _finish(self) -> None:
        st = self.state
        if self.cluster is not None:
            got = self._run(_rank_finish)
            st.loss = got[0][0]
            st.losses.append(st.loss)
            self._take([g[1] for g in got])
            st.peak_bytes = [got[s["rank"]][2] for _, s in sorted(st.ranks.items())]
        st.running, st.finished, st.timestep = False, True, st.n_timesteps

    def _take(self, states: list[dict]) -> None:
        """Keep the state of the first global rank of each pipeline rank (the dp 0, tp 0 pipeline)."""
        ranks: dict[int, dict] = {}
        for s in states:
            ranks.setdefault(s["pp_rank"], s)
        self.state.ranks = ranks

    # ------------------------------------------------------------ widgets (lazy)
    def widget(self):
        """Step / Play / Pause / Reset buttons, a timesteps-per-step slider, status, errors, grid and memory figures."""
        if self._ui is None:
            self._ui = self._build()
            self._redraw()
        return self._ui["box"]

    def _build(self) -> dict:
        import ipywidgets as w

        ui = {"status": w.HTML(), "loss": w.HTML(), "errors": w.Output()}  # errors: a failed click, whole

        def one():  # one step of self.k timesteps (the slider's)
            return self.step(redraw=False)

        for name, tip, action in (
                ("Step", "run the next timesteps on every rank", lambda: self._start(one)),
                ("Play", "step until the training step has finished", lambda: self._start(one, repeat=True)),
                ("Pause", "stop playing after the step under way", self.pause),
                ("Reset", "finish a step under way, then start the grid afresh",
                 lambda: self._start(lambda: self.reset(redraw=False)))):
            ui[name] = w.Button(description=name, tooltip=tip, button_style="primary" if name == "Step" else "")
            ui[name].on_click(lambda _, action=action: action())
        ui["Pause"].disabled = True
        ui["k"] = w.IntSlider(value=self.k, min=1, max=max(1, self.state.n_timesteps), description="timesteps")
        ui["k"].observe(lambda change: setattr(self, "k", change["new"]), names="value")
        ui["grid"], ui["memory"] = figure_view(self.figure()), figure_view(self.memory_figure())
        ui["box"] = w.VBox([w.HBox([ui[b] for b in ("Step", "Play", "Pause", "Reset", "k")]), ui["status"],
                            ui["loss"], ui["errors"], ui["grid"], ui["memory"]])
        return ui

    # ------------------------------------------------------------ the buttons' work, off the kernel's loop
    def _work(self, unit, repeat: bool, delay: float | None):
        """``unit`` (one blocking call to the ranks), then again while ``repeat`` and the step runs and no
        Pause came; the widgets redraw between units at most every ``delay`` s."""
        delay = self.delay if delay is None else delay
        last = time.monotonic()
        yield unit
        while repeat and self.state.running and not self._pause:
            if time.monotonic() - last >= delay:
                self._redraw()
                last = time.monotonic()
            yield unit

    def _start(self, unit, repeat: bool = False, delay: float | None = None):
        """A button's work: under a running event loop a task (returned at once) that awaits each unit in a
        worker thread; else done now (returns None). Either way the buttons are disabled meanwhile and
        enabled after, and an error is shown in the widget and kept in ``self.error``."""
        if self.busy:
            return self._task
        self._busy(True, playing=repeat)
        work = self._work(unit, repeat, delay)
        if running_loop() is None:
            try:
                for unit in work:
                    unit()
            except Exception as exc:  # noqa: BLE001 - a button has nowhere else to report
                self._report(exc)
            finally:
                self._busy(False)
            return None
        self._task = keep_quiet(asyncio.get_running_loop().create_task(self._drive(work)))
        return self._task

    async def _drive(self, work):
        try:
            for unit in work:
                await off_loop(unit)  # the kernel keeps serving messages while the ranks work
                await asyncio.sleep(0)  # and between steps
        except Exception as exc:
            self._report(exc)
            raise
        finally:
            self._busy(False)
        return self.state

    def _busy(self, busy: bool, playing: bool = False) -> None:
        self.busy, self._pause = busy, False
        if busy:
            self.error = None
        ui = self._ui
        if ui is None:
            return
        for name in ("Step", "Play", "Reset"):
            ui[name].disabled = busy
        ui["Pause"].disabled = not (busy and playing)
        if busy:
            ui["errors"].outputs = ()
        else:
            self._redraw()

    def _report(self, exc: BaseException) -> None:
        """Keep the error and show it whole in the widget's output area, its first line in the status."""
        self.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if self._ui is not None:
            self._ui["errors"].append_stderr(self.error + "\n")

    def _redraw(self) -> None:
        ui = self._ui
        if ui is None:
            return
        st = self.state
        head = repr(st).splitlines()
        lines = [html(line) for line in [head[0]] + [x for x in head if x.startswith("pp rank")]]
        if self.error:
            lines.append(f"<span style='color:#b00020'>{html(self.error.splitlines()[0])}</span>")
        ui["status"].value = "<br>".join(lines)
        ui["loss"].value = (f"<b>loss of step {len(st.losses)}: {st.loss:.4f}</b>" if st.loss is not None else "")
        redraw(ui["grid"], self.figure())
        redraw(ui["memory"], self.memory_figure())

    def __repr__(self) -> str:
        return f"ScheduleStepper({repr(self.state)})"


def _magic_cluster():

    state = find()
    cluster = state.cluster if state is not None else None
    if cluster is None or not cluster.running:
        raise StepperError("no cluster to step: pass ScheduleStepper(cluster, batch), start one with "
                           "%colossal start -n 4, or pass a PipelinePlan to walk it without an engine")
    return cluster

"""One executor for every schedule: run this rank's actions of a lowered plan, in order.

``engine.pipeline`` is a ``PipelineExecutor``. The training step (``colab_kit.engine.step``) hands it
a step's microbatches (``begin(work)``, a ``MicrobatchWork``) and takes back the local loss
(``finish()``); in between, ``advance(k)`` runs the next k timesteps of the plan's lockstep grid
(``check.steps``) on this rank, so a notebook can step all ranks together and look at ``state()``.
The executor runs actions and returns: the gradient sync, the optimizer and the global loss are the
step's. What each action does on this rank:

====  =====================================================================================
F     run the stage on its input (tokens on stage 0, else the received activation as a
      leaf that requires grad); the last stage adds the loss / microbatches; keep
      (input, output) for backward
B     full backward of the stage from the received output gradient (the loss on the last
      stage): weight gradients accumulate, the input gradient is kept for SB
I     input gradient only, the zero-bubble split (``zero_bubble``, Qi et al. 2023):
      ``store.backward_input(output, grad)`` runs the backward with a ``WeightGradStore``
      active: each linear computes ``dx = g W`` and keeps ``(x, g)``; LayerNorms, embeddings
      and the 2D/3D layers get their gradients now; the graph is freed, and until W the
      microbatch is held as the store's bytes (its linears' inputs and output gradients)
W     ``store.run(ready=engine.data_parallel.ready)``: ``dW = g^T x`` and ``db = sum g`` per linear,
      added in place into ``.grad`` (the dp buckets told each gradient is ready); I + W
      costs the FLOPs of one B. On the first stage nothing waits for I (it sends no input
      gradient), so the split buys nothing there: its I only keeps the received gradient
      and its W runs the whole backward, B's one pass (same FLOPs; under ZB-H1 rank 0 runs
      them back to back, under ZB-V what the plan put between them runs sooner)
SF/SB ``isend`` of the activation / input gradient to the neighbour pp rank (same dp and tp
      coordinates), after waiting for the earlier sends to that rank; each send is dropped,
      with its tensor, before the first action after it completed (``messages``)
RF/RB blocking receive, at most ``timeout`` seconds (else ``PipelineHang``, see ``hang``)
====  =====================================================================================

Worked example, ``ParallelConfig(pp=2, microbatches=2, schedule="1f1b")``, 8 rows per step::

    rank 0 (stage 0: embeddings, blocks 0-1): 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1
        rows 0-3 and 4-7 through its blocks, sends the activations, gets gradients back
    rank 1 (stage 1: blocks 2-3, ln_f, head):  1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1
        loss of microbatch i = mean token cross-entropy / 2; the step's loss is their sum,
        sent to every rank with an all-reduce over pp (then averaged over dp and tp)

Stepping, on every rank (``cluster.run`` or ``%colossal``), the same example::

    step = engine.step
    step.begin(batch)             # timestep 0, nothing run
    step.advance()                # timestep 0: rank 0 runs 0F0, rank 1 nothing yet
    step.advance_to(3)            # timesteps 1, 2: rank 0 runs 0SF0 0F1, rank 1 runs 1RF0
    step.state()["held"]          # rank 0: ['0F0', '0F1'] (kept for backward); rank 1: []
    loss = step.finish()          # the rest, then gradients, optimizer step, global loss

Stepping cannot deadlock: in the grid (``check.steps``, one action per rank per timestep)
a receive sits at a later timestep than its send, and a send waits only for messages its
rank issued before it. So when every rank runs all its actions before timestep T, each
receive's message was posted by a peer that needed nothing at or after that timestep: by
induction on the timestep every wait ends (``order``'s docstring has the argument in full).
A stepped step runs the same actions in the same order as ``train_step``, so its losses and
parameters are the same bit for bit.

The engine's first ZB-V plan is ordered on each stage's FLOPs (``build_plan_for(config,
model_cfg)``, ``costs.flop_costs``: the first stage's whole backward in W, the head on the last),
not on equal unit steps; ``replan()`` (on every rank, between steps) measures each stage's
actions in the last step's timeline, all-reduces them and installs ``build_plan("zb-v", ...,
costs=...)``: the same actions, in an order fitted to what they cost.

Data parallelism: the dp gradient buckets (``data.DataParallel``) hold this rank's stage
parameters; they accumulate over the microbatches, and with one stage per rank the
all-reduce starts during the last B (or W) of the plan, else after it (so does a bucket
holding a parameter whose gradient comes in I, like a LayerNorm's). The sends and
receives live in ``p2p`` (``CommActions``); the hang reports in ``hang``.
"""
from __future__ import annotations

import random
import time
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..config import Axis
from .. import comm
from .check import steps
from .hang import HangMonitor, PipelineHang, hang_message
from .actions import Action
from .work import MicrobatchWork
from .lowering import lower
from .messages import CommActions, _last, receives_ahead
from .order import send_timesteps
from .compute import ComputeActions
from ..tensor.zero_bubble import use_split_backward
from .costs import measured_costs, shorter_plan
from .schedules import build_plan, build_plan_for

__all__ = ["PipelineExecutor", "PipelineHang"]


class PipelineExecutor(ComputeActions, CommActions):
    """This rank's pipeline: its stages, the lowered plan, stepping and hang reports."""

    timeout: float = 60.0
    """Seconds a receive (or a send's completion) may wait before ``PipelineHang``."""

    def __init__(self, stages, mesh, config, events: list, model_cfg=None):
        """``stages``: this rank's ``Stage`` modules; ``events``: the step's timeline, where each action
        is recorded (the engine's); ``model_cfg``: the dense model's config (the ZB-V plan reads its FLOPs)."""
        self.mesh, self.config, self.events, self.model_cfg = mesh, config, events, model_cfg
        self.stages = {st.index: st for st in stages}
        self.params = {s: [p for p in st.parameters() if p.requires_grad] for s, st in self.stages.items()}
        self.pp, self.me = self.config.pp, self.mesh.rank(Axis.PP)
        self.coords = self.mesh.coords()
        self._plan = None
        self._shapes, self._shapes_sent = {}, set()
        self.monitor = HangMonitor(_agree_nonce(self.mesh), dist.get_world_size(), self.mesh.global_rank)
        weakref.finalize(self, HangMonitor.close, self.monitor)  # an engine dropped without close()
        self.broken: str | None = None
        """Why this pipeline runs no more steps (a hang or a failed rank in an earlier step), or None."""
        self.step, self.running, self.timestep, self.pos = 0, False, 0, 0
        self.t0 = time.perf_counter()
        self._actions: list[Action] = []
        self._index: list[int] = []
        self._x: list = []
        self._set("paused")

    # ------------------------------------------------------------------ the plan
    @property
    def plan(self):
        """The lowered plan this rank runs (built from the config on first use; assign to replace)."""
        if self._plan is None:
            self.plan = build_plan_for(self.config, self.model_cfg)  # zb-v: on the stages' FLOPs
        return self._plan

    @plan.setter
    def plan(self, plan) -> None:
        if self.running:
            raise RuntimeError("a step is running: finish() it before changing the plan")
        if (plan.pp, plan.chunks) != (self.pp, self.config.chunks):
            raise ValueError(f"the plan has pp={plan.pp}, chunks={plan.chunks} but the engine was built for "
                             f"pp={self.pp}, chunks={self.config.chunks}")
        if sorted(self.stages) != plan.stages_of(self.me):
            raise ValueError(f"the plan puts stages {plan.stages_of(self.me)} on pipeline rank {self.me} "
                             f"({plan.placement} placement) but this rank holds stages {sorted(self.stages)}: "
                             f"use a plan with the engine's placement (schedule {self.config.schedule!r})")
        plan = lower(plan)
        rows = steps(plan)  # checks the plan: a broken one raises PlanError here, in every rank
        self.timesteps = [[t for t, row in enumerate(rows) if row[r] is not None] for r in range(plan.pp)]
        self.n_timesteps, self._plan = len(rows), plan
        self._sent_at = send_timesteps(plan, self.timesteps)

    def replan(self, costs: dict | None = None) -> dict:
        """ZB-V re-scheduled from per-stage costs (``costs.zb_v_timed``); call it on every rank.

        ``costs=None`` measures them from the last training step's timeline (``costs.measured_costs``:
        an all-reduce, so every rank builds the same plan). The plan scheduled on them is installed
        unless the engine's first plan (``build_plan_for``: on the stages' FLOPs) simulates shorter
        under the same costs; then that one stays. Returns the costs used::

            engine.train_step(batch)                # a step with the FLOP-ordered plan (and warm-up)
            costs = engine.pipeline.replan()        # {(0, 'F'): 0.0021, (0, 'I'): 0.0, (0, 'W'): 0.0040, ...}
            engine.train_step(batch)                # the same F, I, W per microbatch, in the fitted order
        """
        if self.config.schedule != "zb-v":
            raise ValueError(f"replan() orders the zb-v schedule from measured costs; this engine runs "
                             f"{self.config.schedule!r}: build it with schedule='zb-v', chunks=2")

        if costs is None:
            if self.running:
                raise RuntimeError("a step is running: finish() it before replan()")
            costs = measured_costs(self.events, range(self.plan.n_stages), self.mesh.device)
        fitted = build_plan("zb-v", self.pp, self.config.microbatches, 2, costs=costs)
        default = build_plan_for(self.config, self.model_cfg)  # on the FLOPs (or unit steps)
        self.plan = shorter_plan(fitted, default, costs)  # the same costs on every rank: the same choice
        return costs

    # ------------------------------------------------------------------ stepping
    def check_can_begin(self) -> None:
        """Refuse a step while one runs, after a broken step, or after ``close()`` (before any collective)."""
        if self.running:
            raise RuntimeError("a pipeline step is already running: advance() or finish() it first")
        if self.broken is not None:
            raise PipelineHang(f"rank {self.mesh.global_rank} runs no more pipeline steps: step {self.step} broke "
                               f"({self.broken}). Messages of that step may still be in flight and the backend may "
                               "have closed connections between ranks, so a new step could read stale data or "
                               "hang: restart the ranks (cluster.restart() or %colossal restart) and boost again",
                               rank=self.mesh.global_rank)
        if self.monitor.closed:
            raise RuntimeError("this engine was closed (engine.close()): boost a new one to train again")

    def begin(self, work: MicrobatchWork, *, forward_only: bool = False) -> None:
        """Start a step on ``work``'s microbatches (this rank's rows, already split); nothing runs yet.
        The step loop (``colab_kit.engine.step``) has reset the timeline and armed the gradient part."""
        self.check_can_begin()
        plan = self.plan
        self.work, self.m = work, plan.microbatches
        self._x, self._y = work.inputs, work.targets
        self._key = (tuple(work.inputs[0].shape), self.m)  # names the activation shapes (equal on both peers)
        mine = self.plan.actions[self.me]
        if any(a.kind in ("I", "W") for a in mine):  # zero-bubble: linears can defer dW to W (idempotent);
            use_split_backward(*(st for s, st in self.stages.items() if s > 0))  # the first stage never splits
        self._index = [i for i, a in enumerate(mine) if not forward_only or a.kind in ("F", "SF", "RF")]
        self._actions = [mine[i] for i in self._index]
        self._ahead = receives_ahead(self._actions, self.prefetch)  # what _post_ahead(j) looks at
        grads = [j for j, a in enumerate(self._actions) if a.kind in ("B", "W")]  # they complete gradients
        self._sync_at = grads[-1] if grads and len(self.stages) == 1 else None  # overlap dp with the last one
        self._leaves: dict = {}  # stage -> the parameters its I passes give gradients to (this step: see _do_I)
        self.forward_only, self.t0 = forward_only, work.t0
        self.step += 1
        self._saved, self._act, self._out, self._gout, self._gin = {}, {}, {}, {}, {}
        self._bytes: dict[tuple[int, int], int] = {}
        self._held, self.peak_bytes, self._sends = 0, 0, []
        self._timed: list = []  # on CUDA: (event dict, start, end CUDA events) of each compute action
        self._side = work.side if not forward_only else None
        self._plan_messages(self._sent_at)  # this step's messages in the order both ends derive
        self.loss = torch.zeros((), device=self.mesh.device)
        self.running, self.timestep, self.pos = True, 0, 0
        self._set("paused")
        self.monitor.start(self.step, self._report)
        self.mesh.abort_flag = self.monitor.flagged  # blocked collectives and receives wake on a report

    def advance(self, k: int = 1) -> dict:
        """Run the next ``k`` timesteps of the plan on this rank (call it on every rank); returns ``state()``."""
        return self.advance_to(self.timestep + k)

    def advance_to(self, timestep: int) -> dict:
        """Run every action of this rank scheduled before ``timestep``; returns ``state()``."""
        if not self.running:
            raise RuntimeError("no pipeline step is running: call begin(batch) first")
        paused = self._since
        if self.pos > 0:  # a pause between advance() calls
            self._event("paused", "idle", paused - self.t0, time.perf_counter() - self.t0)
        ts = self.timesteps[self.me]
        try:
            while self.pos < len(self._actions) and ts[self._index[self.pos]] < timestep:
                self._run(self.pos)
                self.pos += 1
        except PipelineHang:
            raise
        except comm.Aborted as exc:  # blocked in a collective when another rank reported
            a = self._actions[self.pos]
            self._set("stopped")
            first = self.monitor.first()
            raise self._hang(f"rank {self.mesh.global_rank} (pp {self.me}) stopped in {a} ({exc}) because rank "
                             f"{first.get('rank')} reported: {first.get('reason')}") from None
        except BaseException as exc:  # tell the other ranks at once, so they stop instead of timing out
            a = self._actions[self.pos]
            self._set("failed", f"{type(exc).__name__}: {_last(exc)}")
            self.monitor.announce(self._report(), f"rank {self.mesh.global_rank} (pp {self.me}) failed in {a}: "
                                  f"{type(exc).__name__}: {_last(exc)}")
            self._end(f"rank {self.mesh.global_rank} failed in {a}: {type(exc).__name__}")
            raise
        self.timestep = max(self.timestep, min(timestep, self.n_timesteps))
        self._set("paused")
        return self.state()

    def finish(self) -> tuple[torch.Tensor, int]:
        """Run what is left and wait for the sends: ``(the local loss, the most activation bytes held)``.
        The step stays watched (a report from another rank still ends it) until ``watching`` ends it."""
        self.advance_to(self.n_timesteps)
        for a, _, pending in self._sends:
            self._set("waiting", f"{a} (its send) to be received")
            self._wait(pending, a, "the peer to receive it")
        self._sends = []
        self._device_seconds()
        if not self.forward_only and self._sync_at is None:
            self.work.data_parallel.arm(sync=True)
        return self.loss, self.peak_bytes

    @contextmanager
    def watching(self, where: str):
        """The end of a step that ``finish`` returned from (the step loop's reductions and optimizer step):
        a collective blocked when another rank reports is a ``PipelineHang`` naming ``where``; the step ends."""
        self._set("done", where)
        try:
            yield
        except comm.Aborted:
            first = self.monitor.first()
            raise self._hang(f"rank {self.mesh.global_rank} (pp {self.me}) stopped {where} because rank "
                             f"{first.get('rank')} reported: {first.get('reason')}") from None
        finally:
            self._end()

    def microbatch_shape(self) -> tuple[int, int] | None:
        """(rows, tokens) of one microbatch of the last step on this rank, or None before a step
        (what the memory estimate counts activations for)."""
        x = self._x
        return (x[0].shape[0], x[0].shape[1]) if x else None

    def state(self) -> dict:
        """Where this rank is: executed actions, the next one, activations held (stage, microbatch)."""
        acts = self._actions
        return {"rank": self.mesh.global_rank, "pp_rank": self.me, "step": self.step, "running": self.running,
                "timestep": self.timestep, "timesteps": self.n_timesteps if self._plan else None,
                "position": self.pos, "of": len(acts), "executed": [str(a) for a in acts[:self.pos]],
                "next": str(acts[self.pos]) if self.pos < len(acts) else None,
                "held": [f"{s}F{m}" for s, m in getattr(self, "_saved", {})], "held_bytes": getattr(self, "_held", 0),
                "loss_so_far": float(self.loss) if self.running else None}

    # ------------------------------------------------------------------ actions
    def _run(self, j: int) -> None:
        a = self._actions[j]
        if self.monitor.flagged.is_set():
            self._set("stopped")
            first = self.monitor.first()
            raise self._hang(f"rank {self.mesh.global_rank} (pp {self.me}) stopped before {a} because rank "
                             f"{first.get('rank')} reported: {first.get('reason')}")
        if self._sends:
            self._settle()  # drop the sends that completed during the last action, and their tensors
        if self.prefetch:
            self._post_ahead(j)
        self._set("running")
        if j == self._sync_at:
            self.work.data_parallel.arm(sync=True)
        start = time.perf_counter() - self.t0
        gpu = None if a.is_comm or self.mesh.device.type != "cuda" else \
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        if a.is_comm:
            getattr(self, "_do_" + a.kind)(a, a.stage, a.microbatch)
        else:  # a recomputed forward in B or I draws the same dropout masks as F did
            if gpu is not None:
                gpu[0].record()
            with self.work.microbatch_at(a.microbatch):
                getattr(self, "_do_" + a.kind)(a, a.stage, a.microbatch)
            if gpu is not None:
                gpu[1].record()
        ev = self._event(str(a), "comm" if a.is_comm else "compute", start, time.perf_counter() - self.t0, a,
                         self.timesteps[self.me][self._index[j]])
        if gpu is not None and ev is not None:
            self._timed.append((ev, *gpu))

    def _event(self, name, kind, start, end, a=None, timestep=None) -> dict | None:
        if self.forward_only:  # evaluate() leaves the last training step's timeline alone
            return None
        ev = {"name": name, "kind": kind, "start": start, "end": end, "rank": self.mesh.global_rank,
              "pp_rank": self.me}
        if a is not None:
            ev.update(action=name, stage=a.stage, microbatch=a.microbatch, timestep=timestep)  # name is str(a)
        self.events.append(ev)
        return ev

    def _device_seconds(self) -> None:
        """On CUDA, each compute action's seconds on the GPU (``device_seconds``, from CUDA events; its host
        ``start``/``end`` are when it was issued, which on a GPU says little of how long it ran): what
        ``costs.measured_costs`` and a ZB-V ``replan`` read. One wait for the step's last event."""
        if self._timed:
            self._timed[-1][2].synchronize()
            for ev, begun, ended in self._timed:
                ev["device_seconds"] = begun.elapsed_time(ended) / 1e3
            self._timed = []

    def _set(self, state: str, note: str = "") -> None:
        """What this rank is doing now (read by the hang monitor's thread)."""
        self._state, self._note, self._since = state, note, time.perf_counter()

    def _report(self) -> dict:
        j, acts = self.pos, self._actions
        at = j < len(acts)  # False once every action ran (waiting for sends, gradients, optimizer)
        return dict(rank=self.mesh.global_rank, pp=self.me, dp=self.coords[Axis.DP], sp=self.coords[Axis.SP],
                    tp=self.coords[Axis.TP], step=self.step, state=self._state, note=self._note,
                    action=str(acts[j]) if at else None, position=self._index[j] if at else None,
                    of=len(self.plan.actions[self.me]), since=time.perf_counter() - self._since,
                    timestep=self.timesteps[self.me][self._index[j]] if at else None,
                    pending=comm.rules.pending())

    def _end(self, broken: str | None = None) -> None:
        """The step is over (done or failed): stop watching; a failure breaks the pipeline for good."""
        if broken and self.broken is None:
            self.broken = broken
        self.running = False
        self.mesh.abort_flag = None
        self.monitor.stop()

    def close(self) -> None:
        """End the hang monitor's thread and its store connection (``engine.close()`` calls it)."""
        if self.running:
            raise RuntimeError("a pipeline step is running: finish() it before closing the engine")
        self.monitor.close()

    def _hang(self, reason: str) -> PipelineHang:
        reports = self.monitor.fail(self._report(), reason)
        self._end(reason.splitlines()[0])
        text = hang_message(reason, reports, self.plan, self.timesteps, self.coords, self.monitor.world,
                            self.timeout, self.monitor.report_wait)
        return PipelineHang(text, reports, self.mesh.global_rank)


def _agree_nonce(mesh) -> int:
    """A number every rank of this job agrees on, naming this executor's keys in the store."""
    t = torch.tensor([random.SystemRandom().getrandbits(62) if dist.get_rank() == 0 else 0], device=mesh.device)
    dist.broadcast(t, src=0)
    return int(t.item())

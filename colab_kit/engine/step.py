"""The one training step every config runs: ``engine.train_step(batch)`` is ``engine.step(batch)``.

In order: the batch split (this rank's rows and tokens, in microbatches), the schedule of forward and
backward work (no pipeline: the microbatches in order; a pipeline: the executor's F/B/I/W actions, which
run and return), gradient sync, clipping, fp16 loss scaling, the optimizer and the scheduler, the records.

Worked example, ``ParallelConfig(dp=2, microbatches=2)``, a global batch of 8 rows, on dp rank 1::

    loss = engine.step(batch)
    # rows 4..7 are this rank's; microbatch 0 = rows 4-5, 1 = rows 6-7
    # forward 0, backward 0 (gradients accumulate), forward 1, backward 1 (the dp buckets all-reduce as
    # they fill), the optimizer steps, the loss is all-reduced: the mean over all 8 rows, on every rank

With a pipeline a step can be stepped, on every rank (``ScheduleStepper`` does so from the notebook)::

    engine.step.begin(batch)        # timestep 0: nothing run yet
    engine.step.advance(2)          # the next two timesteps of the plan on this rank
    engine.step.state()["held"]     # e.g. ['0F0', '0F1']: activations kept for backward
    loss = engine.step.finish()     # the rest, then the same end as train_step: the same losses bit for bit
"""
from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from .agree import agree_on_batch
from .batch import check_batch
from ..config import Axis
from .. import comm
from ..measure import ActivationMeter
from ..models import moe_context
from ..models.hf_moe import CountsRelay, RouterLoss
from ..models.moe import MoE, has_experts
from ..pipeline.executor import PipelineExecutor
from ..pipeline.work import MicrobatchWork
from ..datasets.loader import LocalBatch, split_batch
from .clipping import clip_, weights
from .parallelize import Parallelized
from ..expert.step import ExpertSteps
from .finish import describe, end_step
from .parts import hooks
from ..precision import LossScaler

__all__ = ["TrainingStep", "StepRecords", "describe"]


@dataclass
class StepRecords:
    """What the steps of one engine recorded (``engine.records``, ``engine.history``, ``engine.step_count``)."""

    steps: list[dict] = field(default_factory=list)
    """One dict per step: {"step" (1, 2, ...), "loss", "skipped", "loss_scale" (fp16), "note", "seconds" (the
    step's wall time on this rank), "input_shape" (the global batch's inputs), "lr" (the first param group's
    learning rate this step took)}, and "grad_norm" (the global norm before clipping) with ``max_grad_norm``."""
    history: list[float] = field(default_factory=list)
    """The global mean loss of every step this engine ran."""
    count: int = 0
    """Steps taken, those a loaded checkpoint had run included (``engine.step_count``)."""
    run: int = 0
    """Steps this engine ran itself."""
    peak: int | None = None
    """The most bytes held at once inside the last step, where something measured it (``step_peak``)."""
    input: tuple[tuple[int, ...], torch.dtype] | None = None
    """``((rows, *shape), dtype)`` of the last step's global inputs (the estimates and throughput read it)."""
    rows: int | None = None
    """Rows of one microbatch on this rank in the last step."""
    seq: int | None = None
    """Tokens of a row on this rank in the last step (the second dimension of its inputs)."""

    def add(self, record: dict) -> None:
        self.count += 1
        self.run += 1
        self.history.append(record["loss"])
        self.steps.append({"step": self.count, **record})


class TrainingStep(ExpertSteps):
    """This rank's training step over ``parts`` (what ``parallelize`` left) and ``optimizer``."""

    def __init__(self, parts: Parallelized, optimizer: torch.optim.Optimizer, *, lr_scheduler=None,
                 max_grad_norm: float | None = None, views=None, views_layout=None,
                 estimate_activations: Callable[[], int] | None = None):
        self.parts, self.optimizer, self.views, self.views_layout = parts, optimizer, views, views_layout
        self.config, self.mesh, self.data_parallel = parts.config, parts.mesh, parts.data_parallel
        self.lr_scheduler, self.max_grad_norm = lr_scheduler, max_grad_norm
        self.scaler = LossScaler() if parts.config.precision == "fp16" else None
        """fp16: the dynamic loss scale; None otherwise."""
        self.meter = ActivationMeter(exclude=list(parts.module.parameters()), live=parts.data_parallel.live)
        self.records = StepRecords()
        self.pipeline = (PipelineExecutor(parts.stages, parts.mesh, parts.config, parts.events, parts.model_cfg)
                         if parts.stages is not None else None)
        self._estimate = estimate_activations
        self._clip: list | None = None  # the clipping weights, worked out at the first step
        self.moe = has_experts(parts.module)
        """Whether this rank runs mixture-of-experts layers (each microbatch then gets a ``MoEStep``)."""
        self._moe_steps: dict[int, moe_context.MoEStep] = {}
        self.n_moe = sum(isinstance(m, (MoE, RouterLoss)) for m in parts.dense_twin.modules())
        """MoE layers in the whole model (every stage): the length of the records the loss all-reduce carries."""
        self._relay = CountsRelay.of(parts.dense_twin, self.moe_step, parts.mesh.device) \
            if self.pipeline is not None else None
        """A Hugging Face MoE model's load-balancing loss under a pipeline: each layer's counts ride the pipeline's
        messages (``models.hf_moe.CountsRelay``); None otherwise."""
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------ the step
    def __call__(self, batch, local: bool = False) -> float:
        """One optimizer step on ``batch`` (global, or this rank's dp rows with ``local``): the global mean loss."""
        if self.pipeline is not None:
            self.begin(batch, local=local)
            return self.finish()
        m = self.config.microbatches
        inputs, targets = self._start(batch, local)
        total = torch.zeros((), device=self.mesh.device)
        for i in range(m):
            self.data_parallel.arm(sync=(i == m - 1), t0=self.t0)
            x, y = split_batch(inputs, m, i, "microbatches"), split_batch(targets, m, i, "microbatches")
            meter = self.meter.measure((x.shape, x.dtype, y.shape))
            with self.timed(f"forward {i}", "compute"), meter, self.microbatch_at(i):
                loss = self.parts.loss_fn(self.parts.logits(self.parts.module(x)), y) / m
            with self.timed(f"backward {i}", "compute"), self.microbatch_at(i):
                self._backward_loss(loss).backward()
            total += loss.detach()
        return self._end(total)

    def begin(self, batch, *, local: bool = False) -> dict:
        """Start a pipeline step on ``batch``; nothing runs yet. Returns the executor's ``state()``."""
        pipe = self._pipe()
        pipe.check_can_begin()
        inputs, targets = self._start(batch, local)
        self.data_parallel.arm(sync=False, t0=self.t0)  # the executor arms the sync before the last B or W
        pipe.begin(self._work(inputs, targets))
        return pipe.state()

    def advance(self, k: int = 1) -> dict:
        """Run the next ``k`` timesteps of the plan on this rank (on every rank); returns ``state()``."""
        return self._pipe().advance(k)

    def advance_to(self, timestep: int) -> dict:
        """Run every action of this rank scheduled before ``timestep``; returns ``state()``."""
        return self._pipe().advance_to(timestep)

    def state(self) -> dict:
        """Where this rank is in the pipeline step (``PipelineExecutor.state``)."""
        return self._pipe().state()

    def finish(self) -> float:
        """Run what is left of a pipeline step, then end it as every step ends: the global mean loss."""
        pipe = self._pipe()
        local, held = pipe.finish()
        with pipe.watching("in the gradient all-reduce, optimizer step or loss all-reduce"):
            self.meter.peak = held
            return self._end(local)

    @torch.no_grad()
    def evaluate(self, batch, local: bool = False) -> float:
        """The global mean loss of ``batch`` without training."""
        self._agree_once(batch, local, "evaluate")
        self.parts.module.eval()
        self._moe_steps = {}  # an evaluation counts its own batch (capacity) and keeps no auxiliary loss
        if self.pipeline is not None:
            pipe = self.pipeline
            pipe.check_can_begin()
            inputs, targets = self.prepare(batch, self.config.microbatches, local)
            pipe.begin(self._work(inputs, targets), forward_only=True)
            local_loss, _ = pipe.finish()
            with pipe.watching("in the loss all-reduce"):
                return self.pipeline_loss(local_loss)
        inputs, targets = check_batch(batch, self.parts, values=self._values_to_check(batch))
        self.count_targets(targets, 1, local)
        with self.moe_at(0):
            logits = self.parts.logits(self.parts.module(self.local_rows(inputs, local)))
        self._moe_steps = {}
        return self.global_mean(self.parts.loss_fn(logits, self.local_rows(targets, local)))

    def _pipe(self) -> PipelineExecutor:
        if self.pipeline is None:
            raise RuntimeError(f"stepping by timesteps needs a pipeline (pp > 1); {self.config.describe()} has "
                               "none: call engine.train_step(batch)")
        return self.pipeline

    def _work(self, inputs: torch.Tensor, targets: torch.Tensor) -> MicrobatchWork:
        m = self.config.microbatches
        return MicrobatchWork(inputs=[split_batch(inputs, m, i, "microbatches") for i in range(m)],
                              targets=[split_batch(targets, m, i, "microbatches") for i in range(m)],
                              loss_fn=self.parts.loss_fn, backward_loss=self._backward_loss, meter=self.meter,
                              microbatch_at=self.microbatch_at, data_parallel=self.data_parallel, t0=self.t0,
                              side=self._relay)

    def optimizer_layout(self) -> list[tuple[torch.Tensor, list[tuple]]]:
        """``(tensor, runs)`` per tensor the optimizer steps, as ``data_parallel.optimizer_layout()`` (a run
        ``(param, start, length, at)``), with a piece that spans two param groups as its views
        (``colab_kit.zero.optimizer``): what the checkpoint maps the optimizer's states with."""
        if self.views:
            self.views.bind()
            return self.views_layout
        return self.data_parallel.optimizer_layout()

    # ------------------------------------------------------------------ the start
    def _start(self, batch, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the first forward: the comm log's step, this rank's rows, the activation
        reserve (offload), the timeline and meters reset, the model in training mode."""
        self._agree_once(batch, local, "train_step")  # the first step only, before its records: not the step's
        self.mesh.log.begin_step()  # before prepare: a local batch's target count is this step's first collective
        inputs, targets = self.prepare(batch, self.config.microbatches, local)
        self._hold_activations()
        self.parts.events.clear()
        if self.parts.sp_plan is not None:
            self.parts.sp_plan.begin_step()
        self.meter.reset()
        self._moe_steps = {}
        self.t0 = time.perf_counter()
        if not self.parts.module.training:  # module.train() walks every submodule: ~0.15 ms a step for 4 layers
            self.parts.module.train()
        return inputs, targets

    _agreed: frozenset = frozenset()
    """Which of "train_step" and "evaluate" checked that the ranks hold the same batch (``agree_on_batch``: at
    the first of each)."""

    def _agree_once(self, batch, local: bool, what: str) -> None:
        if what not in self._agreed:
            agree_on_batch(batch, self.mesh, local, what)
            self._agreed = self._agreed | {what}

    _values_checked = False
    """Whether a batch's ids and targets were read once (``check_batch``: on a GPU, at the first step only)."""

    def _values_to_check(self, batch) -> bool:
        """Whether ``check_batch`` reads this batch's values: every batch on the CPU, the first one on a GPU."""
        on_cpu = not isinstance(batch, (tuple, list)) or all(t.device.type == "cpu" for t in batch
                                                               if torch.is_tensor(t))
        first, self._values_checked = not self._values_checked, True
        return on_cpu or first

    def prepare(self, batch, microbatches: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` of ``batch`` (global, or this rank's dp rows with ``local``),
        after telling the loss and the dropout where they sit; a batch that does not split is refused
        before any collective."""
        inputs, targets = check_batch(batch, self.parts, values=self._values_to_check(batch))
        dp, rows = self.config.dp, inputs.shape[0]
        said = batch.global_rows if isinstance(batch, LocalBatch) else None
        if local and said is not None and said != rows * dp:
            raise ValueError(f"this LocalBatch holds {rows} rows of a global batch of {said}, and dp={dp} ranks make "
                             f"{rows * dp}: build the loader for this engine (engine.loader(dataset, {said}))")
        need, what = (microbatches, "this rank's batch") if local else (dp * microbatches, "a global batch")
        if rows % need:
            raise ValueError(f"{what} of {rows} rows does not split over "
                             f"{'' if local else f'dp={dp} x '}microbatches={microbatches}: use a multiple of "
                             f"{need} rows")
        self.count_targets(targets, microbatches, local)
        global_rows = rows * dp if local else rows
        self.records.input = ((global_rows, *inputs.shape[1:]), inputs.dtype)
        if self.parts.dropout is not None:
            self.parts.dropout.begin(global_rows, microbatches)
        x, y = self.local_rows(inputs, local), self.local_rows(targets, local)
        self.records.rows, self.records.seq = x.shape[0] // microbatches, x.shape[1] if x.dim() > 1 else None
        return x, y

    def count_targets(self, targets: torch.Tensor, microbatches: int, local: bool = False) -> None:
        """Tell the loss how many targets the global batch counts (``TokenLoss``), before a step or an
        evaluation splits it into ``dp * microbatches * loss_shards`` pieces; with ``local`` the count is
        summed over dp (one all-reduce of a number)."""
        token_loss = self.parts.token_loss
        if token_loss is None:
            return
        pieces = self.config.dp * microbatches * self.loss_shards
        if not local:
            token_loss.count(targets, pieces)
            return
        n = (targets != -100).sum().reshape(1).to(self.mesh.device)
        comm.all_reduce(n, self.mesh, Axis.DP, tag="target count")
        token_loss.scale = pieces / max(int(n.item()), 1)

    def local_rows(self, rows: torch.Tensor, local: bool = False) -> torch.Tensor:
        """This rank's rows of the global batch: its dp share (given already with ``local``), then its share
        inside tp, then its tokens of each row over sp."""
        if not local:
            rows = split_batch(rows, self.config.dp, self.mesh.rank(Axis.DP))
        if self.parts.tp_plan is not None:
            rows = self.parts.tp_plan.shard_batch(rows)
        if self.parts.sp_plan is not None:
            rows = self.parts.sp_plan.shard_tokens(rows)
        return rows.to(self.mesh.device)

    @property
    def loss_shards(self) -> int:
        """What each rank's mean loss is divided by before backward: the ranks that share its rows (the tensor
        plan's batch axes) times those that share its sequences (sp); with the dp buckets' 1/dp and the sums
        over tp and sp, the gradients are the global mean's."""
        tp = self.parts.tp_plan
        return (tp.batch_shards if tp is not None else 1) * self.config.sp

    @contextmanager
    def microbatch_at(self, microbatch: int):
        """The context microbatch ``microbatch``'s forward, backward and recomputation run in: each part's
        "microbatch" hook (``engine.parts``: the dropout coordinates; with MoE layers, the ``MoEStep``), nested
        in the parts' order."""
        with ExitStack() as stack:
            for _, enter in hooks("microbatch"):
                stack.enter_context(enter(self, microbatch))
            yield

    def _backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from: the loss times the fp16 scale, over the ranks that share its terms."""
        scaled = loss if self.scaler is None else self.scaler.scale_loss(loss)
        return scaled / self.loss_shards

    def _hold_activations(self) -> None:
        """With a device account (offload): reserve the step's activations on it before the step, the larger of
        the last step's measurement and the estimate; refuse a budget that cannot hold one step before any runs."""
        place = self.data_parallel.placement
        if place is None:
            return
        acts = self.activation_reserve()
        if place.budget is not None and self.records.count == 0:
            place.check_step(place.chunks, acts)
        place.hold("activations", acts)

    def activation_reserve(self) -> int:
        """What a step reserves for activations on a device account: the larger of the last step's measurement
        and the estimate."""
        return max(self.meter.peak, self._estimate() if self._estimate is not None else 0)

    # ------------------------------------------------------------------ the end
    def _end(self, local: torch.Tensor) -> float:
        """After the last backward: ``engine.finish.end_step`` (the list: gradient sync, each part's gradient
        finishing, the optimizer, each part's after-optimizer work, the loss, the records)."""
        return end_step(self, local)

    def clip_now(self, max_norm: float) -> float:
        """Clip every gradient shard to the global ``max_norm``; the norm before clipping."""
        if self._clip is None:  # the optimizer's tensors do not change: the weights once
            self._clip = weights(self.mesh, self.parts.placement_table, self.config, self.data_parallel,
                                 self.parts.tied)
        return clip_(self.mesh, self._clip, max_norm)

    def pipeline_loss(self, local: torch.Tensor) -> float:
        """The last stage holds the loss, the other stages zero: sum over pp, then mean over dp, sp and tp."""
        return self.mean(local, pp=True)[0]

    def global_mean(self, local: torch.Tensor) -> float:
        """Mean over dp, sp and tp of each rank's mean loss (tp ranks that share rows agree; sp ranks hold equal
        numbers of tokens, so the mean of their means is the mean over the whole sequence)."""
        return self.mean(local)[0]

    def mean(self, local: torch.Tensor, pp: bool = False) -> list[float]:
        """``local`` (a loss, or a vector of them) summed over pp when ``pp``, then averaged over dp, sp and tp."""
        local = local.reshape(-1).clone()
        for axis in (Axis.PP,) * pp + (Axis.DP, Axis.SP, Axis.TP):
            comm.all_reduce(local, self.mesh, axis, tag="loss")
        return (local.double() / (self.config.dp * self.config.sp * self.config.tp)).tolist()

    @contextmanager
    def timed(self, name: str, kind: str):
        """Record the enclosed work as one event of this step's timeline."""
        start = time.perf_counter() - self.t0
        yield
        self.parts.events.append({"name": name, "kind": kind, "start": start, "end": time.perf_counter() - self.t0})


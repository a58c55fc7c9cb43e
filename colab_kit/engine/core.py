"""``boost(model, optimizer_factory, config)``: compose the parallel parts into one ``Engine``.

Every rank calls ``boost`` with the same dense model (built from the same seed)
and the same config; the engine shards what the config asks for and trains so
that the losses equal one process training the dense model on the whole batch.

Inside each rank of ``ParallelConfig(dp=4)``, with a global batch of 16 rows::

    engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=3e-3), cfg)
    loss = engine.train_step((inputs, targets))   # inputs [16, T] on every rank
    # rank r runs rows 4r..4r+3, all-reduces gradients over dp in buckets during
    # backward, steps the optimizer; loss is the mean over all 16 rows, same on every rank

The model may also be built on the meta device (``GPT(cfg, device="meta")``): then each
rank makes only its own shards, with the values the dense model would hold
(``colab_kit.engine.sharded_init``), so no rank ever holds the whole model. ``engine.close()`` releases
the engine's hold on its mesh (shared by every engine of one config) and its threads.

What runs now: data parallelism (any dp) with gradient accumulation over
``config.microbatches``, composed with tensor parallelism (``colab_kit.tensor``)
and pipeline parallelism (``colab_kit.pipeline``: the model cut into ``pp * chunks``
stages, any schedule run by one executor, ``engine.pipeline`` to step it); ZeRO over dp
(``colab_kit.zero``: stages 1 and 2 build the optimizer over this rank's flat pieces,
reduce-scatter gradients and all-gather the updated pieces; stage 3 shards the parameters
in per-block chunks gathered around each use); ``offload`` "cpu" and "auto" (with
``device_budget``); mixed precision (``colab_kit.engine.precision``); recomputation; sequence
parallelism (``colab_kit.sequence``: ring and Ulysses over the sp axis, split_gather inside the
1D tensor group). Sequence parallelism with the 2D/2.5D/3D tensor modes and ZeRO-3 with a
pipeline are refused with a ConfigError that says so (``unsupported``); the engine never falls
back to another mode.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.nn as nn

from .. import comm
from ..config import ConfigError, ParallelConfig
from ..zero.stage0 import ZeroStage0, GradientPart
from ..datasets.loader import split_batch
from ..measure import ActivationMeter
from .records import EngineRecords
from ..mesh import ProcessMesh
from ..precision import LossScaler, MasterWeights, loss_in_fp32, master_step, to_compute_dtype
from .loss import TokenLoss, lm_loss, token_losses
from .checks import check_policy
from ..tensor import plan_for, sync_grads
from ..datasets import ShardedLoader
from ..dropout import DropoutLayout
from ..memory.timeline import memory_timeline
from ..models.dropout import has_dropout, layout_invariant
from ..observe.profile import profile
from ..observe.roofline import roofline
from ..observe.throughput import engine_throughput
from ..pipeline.executor import PipelineExecutor
from ..pipeline.stage import defer_stages as defer, split_model, tied_across_ranks
from ..placement import PlacementTable
from ..recompute import recompute_blocks
from ..sequence.plan import SequencePlan
from ..sharded_init import materialize, meta_twin
from ..zero import ZeroStage1, ZeroStage2
from ..zero.optimizer import OptimizerSpec, attach_scheduler, check_elementwise, check_scheduler, local_names, rebuild
from ..zero.stage3 import ZeroStage3
from .clipping import check_max_norm, clip_
from .fit import fit
from .generate import generate

__all__ = ["boost", "Engine", "lm_loss", "unsupported", "check_policy", "TokenLoss"]


def unsupported(config: ParallelConfig) -> str | None:
    """Why ``boost`` refuses a valid ``config`` today (the message of the ConfigError it raises), or None.

    ConfigPicker shows the same text as "valid, not runnable yet"::

        unsupported(ParallelConfig(dp=2, tp=2))   # None: boost runs it
        unsupported(ParallelConfig(dp=2, pp=2, zero=3))  # "this version of the engine does not run ZeRO
                                  # stage 3 with pipeline parallelism yet (...): set zero=2 with pp (...)"

    ZeRO stage 3 with a pipeline is refused on purpose: each stage would gather its parameters
    for every microbatch's forward and backward (2 x microbatches all-gathers per step), or keep
    them whole through the step, which is stage 2's memory at stage 3's traffic.
    """
    cfg = config
    todo = [(cfg.sp > 1 and cfg.tp > 1 and cfg.tp_mode != "1d",
             f"sequence parallelism (sp={cfg.sp}) with tp_mode={cfg.tp_mode!r}", "tp_mode='1d' with sp, or sp=1"),
            (cfg.zero == 3 and cfg.pp > 1, "ZeRO stage 3 with pipeline parallelism",
             "zero=2 with pp (stage 3 would gather each stage's parameters for every microbatch's forward and "
             "backward), or zero=3 with pp=1"),
            (cfg.sp_mode == "split_gather" and cfg.tp_mode != "1d",  # its plan splits 1D's layers only
             f"sp_mode='split_gather' with tp_mode={cfg.tp_mode!r}", "tp_mode='1d' with split_gather")]
    missing = [(what, fix) for cond, what, fix in todo if cond]
    if not missing:
        return None
    whats = "; ".join(w for w, _ in missing)
    fixes = " ".join(f for _, f in missing)
    return (f"this version of the engine does not run {whats} yet (data, tensor and pipeline parallelism, "
            f"sequence parallelism, ZeRO stages 1 to 3, offload and mixed precision are what run today): set {fixes}")


def boost(model: nn.Module, optimizer, config: ParallelConfig, *, policy=None,
          mesh: ProcessMesh | None = None, loss_fn: Callable = lm_loss, bucket_bytes: int | None = None,
          device_budget: int | None = None, max_grad_norm: float | None = None, lr_scheduler=None) -> "Engine":
    """Shard ``model`` for ``config`` on this rank and return its ``Engine``.

    ``optimizer``: a ``torch.optim.Optimizer`` built over the dense ``model``'s parameters, with any param
    groups and per-group settings, rebuilt over this rank's shards (``colab_kit.engine.optimizer``); or a factory
    ``params -> optimizer`` called with the tensors this rank steps. ``lr_scheduler``: a torch scheduler
    built over that optimizer (or a function ``optimizer -> scheduler``); ``train_step`` steps it once per
    step, after the optimizer, and ``engine.save``/``load`` carry it. ``policy``
    (``colab_kit.policy.Policy``) says what each part of ``model`` is; the built-in models (GPT,
    BERT, ViT) have theirs. Tensor, pipeline and sequence parallelism and recomputation need one;
    data parallelism and ZeRO take any module.
    ``mesh`` defaults to ``ProcessMesh.shared(config)``: one mesh per config, reused by every
    engine of that config until the last of them is closed (``engine.close()``).
    ``bucket_bytes`` sets the size of the gradient all-reduce buckets (default: about a
    quarter of the gradients, 64 KiB to 25 MB). ``max_grad_norm``: clip every step's gradient to this global
    norm, over every shard, as ``torch.nn.utils.clip_grad_norm_`` in one process (``colab_kit.engine.clipping``);
    each step's norm is in ``engine.records`` (``"grad_norm"``).
    """
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ck.ParallelConfig, got {type(config).__name__}")
    if config.offload == "auto" and device_budget is None:
        raise ConfigError("offload='auto' places chunks under a device budget: pass boost(..., device_budget=BYTES), "
                          "e.g. device_budget=2**30 for 1 GiB per rank")
    if device_budget is not None and config.offload != "auto":
        raise ConfigError(f"device_budget applies to offload='auto' (got offload={config.offload!r}): "
                          "set offload='auto' with zero=3, or drop device_budget")
    if device_budget is not None and (isinstance(device_budget, bool) or not isinstance(device_budget, int)
                                      or device_budget <= 0):
        raise ConfigError(f"device_budget must be a positive number of bytes, got {device_budget!r}")
    why = unsupported(config)
    if why is not None:
        raise ConfigError(why)
    check_max_norm(max_grad_norm)
    if isinstance(optimizer, torch.optim.Optimizer):  # read before the model is sharded: names, groups, settings
        spec = OptimizerSpec.capture(optimizer, model)
    elif callable(optimizer):
        spec = None
    else:
        raise ConfigError(f"boost takes a torch.optim.Optimizer over the model's parameters, or a factory "
                          f"params -> optimizer; got {type(optimizer).__name__}")
    check_scheduler(lr_scheduler, optimizer if spec is not None else None)
    if spec is not None and config.zero:
        check_elementwise(spec.kind, "ZeRO steps flat pieces of several parameters")
    if spec is not None and config.tp > 1:
        check_elementwise(spec.kind, f"tensor parallelism ({config.tp_mode}) gives each rank a block of each matrix")
    policy = check_policy(model, config, policy)  # sizes that do not divide: refused before any collective
    owned = mesh is None
    mesh = mesh or ProcessMesh.shared(config)
    if mesh.config != config:
        raise ConfigError(f"the mesh was built for {mesh.config.describe()} but boost was given "
                          f"{config.describe()}: pass the same config to both")
    try:
        engine = Engine(model, spec if spec is not None else optimizer, config, mesh, loss_fn, bucket_bytes,
                        device_budget, policy)
        engine.lr_scheduler = attach_scheduler(lr_scheduler, optimizer if spec is not None else None,
                                               engine.optimizer)
    except BaseException:
        if owned:
            mesh.release()
        raise
    engine.max_grad_norm = max_grad_norm
    if owned:  # given back by close(); for an engine dropped without it, by the next boost (ProcessMesh.prune)
        mesh.track(engine)
        engine._owns_mesh = True
    return engine


class Engine(EngineRecords):
    """One rank's share of a training job: model, optimizer, communication, records."""

    def __init__(self, model, optimizer, config, mesh, loss_fn=lm_loss, bucket_bytes=None,
                 device_budget=None, policy=None):
        self.config, self.mesh, self.loss_fn = config, mesh, loss_fn
        self.model_cfg = getattr(model, "cfg", None)
        """The dense model's config (``GPTConfig``, ``BERTConfig``, ...), whatever the split; None for another model."""
        self.policy = policy
        """The ``colab_kit.policy.Policy`` the parallel parts lowered (None: a model under dp / ZeRO only)."""
        self._logits = policy.output if policy is not None and policy.output is not None else (lambda out: out)
        self.dense_twin = meta_twin(model)  # shapes and names only: the dense model the checkpoint maps elements to
        self.tp_plan = None
        defer(model, config, mesh.rank("pp"), policy)
        hf = getattr(model, "config", None)
        if getattr(hf, "use_cache", False):  # a training step reads no KV cache; a recomputed forward would
            hf.use_cache = False            # append its keys to it a second time
        dropout = has_dropout(model)
        if dropout:  # masks from global coordinates: every split draws what one process draws
            layout_invariant(model, policy=policy)
        self._token_loss = None
        if loss_fn is lm_loss:  # the contract's loss, exact on uneven counts of predicted tokens (TokenLoss)
            self._token_loss = self.loss_fn = TokenLoss(token_losses)
        if config.tp > 1:
            self.tp_plan = plan_for(mesh)
            model = self.tp_plan.parallelize(model, policy)
            if self._token_loss is not None:
                self._token_loss.per_token = self.tp_plan.token_losses
        self.sp_plan = None
        """With sp > 1 ("ring" or "ulysses"), the ``SequencePlan``: this rank's tokens, the ring's records."""
        if config.sp > 1:  # after the tensor plan: attention on this rank's heads and tokens
            self.sp_plan = SequencePlan(mesh)
            model = self.sp_plan.parallelize(model, policy)
        self._dropout = DropoutLayout(mesh, self.tp_plan, self.sp_plan) if dropout else None
        """With dropout in the model: where this rank's tensors sit, set around each microbatch."""
        if config.recompute:  # each block keeps its input only, runs its forward again in backward
            recompute_blocks(model, policy)  # before the split: the stages hold these same blocks
        stages = None
        self._tied = []
        """With pp, tied weights whose first and last stage are on different pipeline ranks: ``(shape, the
        parameter here or None)`` per pair; their gradients are summed over pp before each step."""
        if config.pp > 1:  # after the tensor plan: each stage holds this rank's tensor shards
            tied = tied_across_ranks(model, config, policy)
            stages = split_model(model, config, mesh.rank("pp"), policy)
            model = nn.ModuleList(stages)
            mine = {id(p) for p in model.parameters()}
            self._tied = [(tuple(t.shape), t if id(t) in mine else None) for t in tied]
        self.module = materialize(model).to(mesh.device)  # what is still meta: whole copies (see colab_kit.engine.sharded_init)
        self._n_local = sum(p.numel() for p in self.module.parameters() if p.requires_grad)  # before ZeRO
        self.placement_table = PlacementTable(self.module)
        """Each parameter's placement on the mesh in DTensor's terms, as its layer declared it
        (``colab_kit.placement``): the gradient sums, ZeRO and the fp32 masters read it."""
        self._rows = None  # rows of the last step's microbatch on this rank (for the activation estimate)
        self.events: list[dict] = []
        with torch.no_grad():  # one starting point even if a rank's seed differed
            for p in self.module.parameters():
                comm.broadcast(p.data, mesh, "dp", tag="init params")
        if config.precision != "fp32":  # a 16-bit model; fp32 masters and reductions (colab_kit.engine.precision)
            to_compute_dtype(self.module, config.precision)
            self.loss_fn = loss_in_fp32(self.loss_fn)
        self.device_budget = device_budget
        """offload='auto': the bytes each rank's device may hold (``colab_kit.zero.offload``); else None."""
        self.scaler = LossScaler() if config.precision == "fp16" else None
        """fp16: the dynamic loss scale (``colab_kit.engine.precision.LossScaler``); None otherwise."""
        spec = optimizer if isinstance(optimizer, OptimizerSpec) else None
        names = local_names(self.module)
        group_of = (lambda p: spec.group_of(names[id(p)])) if spec is not None and len(spec.hypers) > 1 else None
        self.grads: GradientPart  # plain dp, or ZeRO stage 1, 2 or 3: one declared interface (colab_kit.zero.stage0)
        if config.zero == 3:  # parameters sharded too: each block gathered before it runs, freed after
            self.grads = ZeroStage3(self.module, mesh, "dp", self.events, offload=config.offload,
                                    device_budget=device_budget,
                                    blocks=policy.block_list(self.module) if policy is not None else None,
                                    placements=self.placement_table, group_of=group_of)
        elif config.zero:  # parameters move into one flat buffer; the optimizer steps this rank's pieces
            part = ZeroStage2 if config.zero == 2 else ZeroStage1
            self.grads = part(self.module.parameters(), mesh, "dp", bucket_bytes, self.events, config.zero,
                              offload=config.offload, placements=self.placement_table, group_of=group_of)
        else:
            self.grads = ZeroStage0(self.module.parameters(), mesh, "dp", bucket_bytes, self.events,
                                     placements=self.placement_table)
        self._build_optimizer(spec or optimizer, names)
        self.activation_meter = ActivationMeter(exclude=list(self.module.parameters()),
                                                live=self.grads.live)
        self.step_count = 0
        self.history: list[float] = []
        self.records: list[dict] = []
        """One dict per train_step: {"step" (1, 2, ...), "loss", "skipped", "loss_scale" (fp16), "note",
        "seconds" (the step's wall time on this rank), "input_shape" (the global batch's inputs), "lr" (the
        first param group's learning rate this step took)}, and
        "grad_norm" (the global norm before clipping) with ``max_grad_norm``."""
        self.pipeline = None
        """With pp > 1, the ``PipelineExecutor`` of this rank: ``begin``/``advance``/``finish``/``state``."""
        if stages is not None:
            self.pipeline = PipelineExecutor(self, stages)

    def _build_optimizer(self, optimizer, names) -> None:
        """The optimizer over what this rank steps (``grads.optimizer_layout()``): a factory called with
        those tensors, or the user's optimizer rebuilt over them group by group (``colab_kit.engine.optimizer``);
        refused where parameters are cut (ZeRO, tp) unless it is elementwise."""
        self._views, self._opt_layout = None, None
        if isinstance(optimizer, OptimizerSpec):
            self.optimizer, self._views, keys, self._opt_layout = rebuild(optimizer, self.grads.optimizer_layout(),
                                                                          names)
            self.grads.set_optimizer(self.optimizer, keys)
        else:  # the parameters, ZeRO's pieces, or their fp32 masters (ZeRO's build checks them)
            self.optimizer = self.grads.build_optimizer(optimizer)
        if self.config.tp > 1:  # (ZeRO's build checks its own; a user's optimizer was checked by boost)
            check_elementwise(self.optimizer, f"tensor parallelism ({self.config.tp_mode}) gives each rank a block "
                                              f"of each matrix")

    def optimizer_layout(self) -> list[tuple[torch.Tensor, list[tuple]]]:
        """``(tensor, runs)`` per tensor the optimizer steps, as ``grads.optimizer_layout()`` (a run
        ``(param, start, length, at)``), with a piece that spans two param groups as its views
        (``colab_kit.engine.optimizer``): what the checkpoint maps the optimizer's states with."""
        if self._views:
            self._views.bind()
            return self._opt_layout
        return self.grads.optimizer_layout()

    # ------------------------------------------------------------------ training
    def train_step(self, batch, *, local: bool | None = None) -> float:
        """One optimizer step on ``batch`` ``(inputs, targets)``; returns the global mean loss.

        ``batch`` is the global batch (the same on every rank), or with ``local=True`` this rank's dp share
        of it (rows ``r*B/dp .. (r+1)*B/dp`` on dp rank r, the same on the ranks of one dp coordinate): what
        ``engine.loader(...)`` yields (a ``LocalBatch``, recognised without ``local=``) or a ``DataLoader``
        with a ``DistributedSampler`` over the dp size and rank. The loss is the global batch's either way."""
        if self.closed:
            raise RuntimeError("this engine was closed (engine.close()): boost a new one to train again")
        local = getattr(batch, "global_rows", None) is not None if local is None else bool(local)
        if self.mesh.device.type != "cuda":
            return self._train_step(batch, local)
        torch.cuda.reset_peak_memory_stats(self.mesh.device)  # engine.memory()["step_peak"]: the allocator's
        value = self._train_step(batch, local)
        self.step_peak = torch.cuda.max_memory_allocated(self.mesh.device)
        return value

    def _train_step(self, batch, local: bool) -> float:
        if self.pipeline is not None:
            self.pipeline.begin(batch, local=local)
            return self.pipeline.finish()
        cfg, mesh = self.config, self.mesh
        m = cfg.microbatches
        mesh.log.begin_step()  # before prepare_batch: a local batch's target count is this step's first collective
        inputs, targets = self.prepare_batch(batch, m, local)
        self._rows, self._seq = inputs.shape[0] // m, inputs.shape[1]
        self._hold_activations(self._rows)
        shards = self.loss_shards
        self.events.clear()
        if self.sp_plan is not None:
            self.sp_plan.begin_step()
        self.activation_meter.reset()
        t0 = time.perf_counter()
        if not self.module.training:  # module.train() walks every submodule: ~0.15 ms a step for 4 layers
            self.module.train()
        local = torch.zeros((), device=mesh.device)
        for i in range(m):
            self.grads.arm(sync=(i == m - 1), t0=t0)
            x, y = split_batch(inputs, m, i, "microbatches"), split_batch(targets, m, i, "microbatches")
            meter = self.activation_meter.measure((x.shape, x.dtype, y.shape))
            with self._timed(f"forward {i}", "compute", t0), meter, self.dropout_at(i):
                loss = self.loss_fn(self._logits(self.module(x)), y) / m
            with self._timed(f"backward {i}", "compute", t0), self.dropout_at(i):
                (self.scale_loss(loss) / shards).backward()
            local += loss.detach()
        return self.finish_step(local, t0)

    def prepare_batch(self, batch, microbatches: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` of a step's ``batch`` (global, or this rank's dp rows with
        ``local``) in ``microbatches``, after telling the loss and the dropout where they sit
        (``count_targets``, ``begin_batch``); a batch that does not split is refused before any collective."""
        inputs, targets = batch
        dp, rows = self.config.dp, inputs.shape[0]
        said = getattr(batch, "global_rows", None)
        if local and said is not None and said != rows * dp:
            raise ValueError(f"this LocalBatch holds {rows} rows of a global batch of {said}, and dp={dp} ranks make "
                             f"{rows * dp}: build the loader for this engine (engine.loader(dataset, {said}))")
        need, what = (microbatches, "this rank's batch") if local else (dp * microbatches, "a global batch")
        if rows % need:
            raise ValueError(f"{what} of {rows} rows does not split over "
                             f"{'' if local else f'dp={dp} x '}microbatches={microbatches}: use a multiple of "
                             f"{need} rows")
        self.count_targets(targets, microbatches, local)
        self.begin_batch(inputs, microbatches, rows * dp if local else rows)
        return self._local_rows(inputs, local), self._local_rows(targets, local)

    def count_targets(self, targets: torch.Tensor, microbatches: int, local: bool = False) -> None:
        """Tell the engine's loss how many targets the global batch counts (``TokenLoss``), before a step or
        an evaluation that splits it into ``dp * microbatches * loss_shards`` pieces; with ``local``,
        ``targets`` are this rank's dp rows and the count is summed over dp (one all-reduce of a number)."""
        if self._token_loss is None:
            return
        pieces = self.config.dp * microbatches * self.loss_shards
        if not local:
            self._token_loss.count(targets, pieces)
            return
        n = (targets != -100).sum().reshape(1).to(self.mesh.device)
        comm.all_reduce(n, self.mesh, "dp", tag="target count")
        self._token_loss.scale = pieces / max(int(n.item()), 1)

    def begin_batch(self, inputs: torch.Tensor, microbatches: int, rows: int | None = None) -> None:
        """A step on the global ``inputs`` (or a piece of a global batch of ``rows`` rows) in
        ``microbatches``: where each microbatch's rows sit, for the layout-invariant dropout
        (``colab_kit.models.dropout``), and the input's shape for the activation estimate of any model
        (``memory_estimate``) and the throughput (``records``)."""
        rows = inputs.shape[0] if rows is None else rows
        self._input = ((rows, *inputs.shape[1:]), inputs.dtype)
        if self._dropout is not None:
            self._dropout.begin(rows, microbatches)

    def dropout_at(self, microbatch: int):
        """The context microbatch ``microbatch``'s forward and backward run in (its dropout coordinates)."""
        if self._dropout is None:
            return nullcontext()
        return self._dropout.at(self.step_count, microbatch)

    def _hold_activations(self, rows: int) -> None:
        """With a device account (offload): reserve the step's activations on it before the step,
        the larger of the last step's measurement and the estimate, and refuse a budget that
        cannot hold one step before any of it runs."""
        place = self.grads.placement
        if place is None:
            return
        est = self.memory_estimate()["activations"] if self.model_cfg is not None else 0
        acts = max(self.activation_meter.peak, est)
        if place.budget is not None and self.step_count == 0:
            place.check_step(self.grads.chunks, acts)
        place.hold("activations", acts)

    def finish_step(self, local: torch.Tensor, t0: float) -> float:
        """After the last backward: reduce gradients, step the optimizer, return the global mean loss.

        The tensor plan's sums over replicated axes come after the dp reduction and before the
        step (sums over different groups commute); with ZeRO on this rank's reduced pieces, then
        the updated pieces are all-gathered back into the parameters.
        """
        self.grads.finish()
        zero = self.config.zero > 0
        masters = self.grads.masters  # mixed precision: fp32 masters, grads set by finish()
        masters = masters if isinstance(masters, MasterWeights) else None
        if self._tied:
            self._sum_tied(masters)
        sums = self.tp_plan is not None or self.sp_plan is not None  # parameters replicated over tp or sp axes
        if sums and (zero or masters is not None):
            self.grads.sync_replicated()
        elif sums:
            sync_grads(self.module, self.mesh, self.placement_table)
        done = {"skipped": False, "loss_scale": None, "note": ""}
        if self._views:  # pieces that span param groups: their views see this step's storage and gradients
            self._views.bind()
        clip = None
        if self.max_grad_norm is not None:  # the global norm over every shard (colab_kit.engine.clipping)
            clip = lambda: clip_(self, self.max_grad_norm)  # noqa: E731
        with self._timed("optimizer step", "compute", t0):
            if masters is None:
                if clip is not None:
                    done["grad_norm"] = clip()
                self.optimizer.step()
            else:  # unscale and check (fp16), clip, step the masters, copy them into the 16-bit parameters
                done = master_step(self.optimizer, masters, self.scaler, self.mesh, before_step=clip)
            self.grads.zero()
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer.param_groups else None  # what this step took
        if self.lr_scheduler is not None:  # once per step, after the optimizer (a skipped fp16 step too)
            self.lr_scheduler.step()
        if done["note"]:  # on the timeline, not the console
            now = time.perf_counter() - t0
            self.events.append({"name": done["note"], "kind": "compute", "start": now, "end": now})
        if zero and not done["skipped"]:
            with self._timed("all_gather params", "comm", t0):
                self.grads.gather_params()
        with self._timed("loss all_reduce", "comm", t0):
            value = self.pipeline_loss(local) if self.pipeline is not None else self._global_mean(local)
        self.step_count += 1
        self.steps_run += 1
        self.history.append(value)
        place = self.grads.placement
        if place is not None:  # offload='auto': the first step measured, the chunks are placed now
            place.after_step()
        if self._views:  # no view keeps a dropped gradient (or a moved chunk's old copy) alive
            self._views.release()
        self.records.append({"step": self.step_count, "loss": value, **done, "seconds": time.perf_counter() - t0,
                             "input_shape": self._input[0], "lr": float(lr) if lr is not None else None})
        return value

    def _sum_tied(self, masters) -> None:
        """A weight the first and the last pipeline stage share (a head tied to the token table) has a
        copy on each of their ranks, each with the gradient of its own use: sum them over pp (the ranks
        between contribute zeros), so both copies take the same step and stay equal (Megatron's way)."""
        for shape, p in self._tied:
            if p is None:  # the gradient's dtype: the fp32 masters', else the model's (16-bit after to_compute_dtype)
                dtype = torch.float32 if masters is not None else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                                   "fp16": torch.float16}[self.config.precision]
                g = torch.zeros(shape, dtype=dtype, device=self.mesh.device)
            elif masters is not None:
                g = masters.params[next(i for i, t in enumerate(masters.model) if t is p)].grad
            else:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = g
            comm.all_reduce(g, self.mesh, "pp", tag="tied grads")

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss that backward starts from: times the fp16 loss scale, else itself."""
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def pipeline_loss(self, local: torch.Tensor) -> float:
        """The last stage holds the loss, the other stages zero: sum over pp, then mean over dp and tp."""
        local = local.reshape(1).clone()
        comm.all_reduce(local, self.mesh, "pp", tag="loss")
        return self._global_mean(local)

    @property
    def loss_shards(self) -> int:
        """What each rank's mean loss is divided by before backward: the ranks that share its rows
        (the tensor plan's batch axes) times those that share its sequences (sp); with the dp
        buckets' 1/dp and the sums over tp and sp, the gradients are the global mean's."""
        return (self.tp_plan.batch_shards if self.tp_plan else 1) * self.config.sp

    def _local_rows(self, rows: torch.Tensor, local: bool = False) -> torch.Tensor:
        """This rank's rows of the global batch: its dp share (given already with ``local``), then its share
        inside tp, then its tokens of each row over sp (a length that does not split is refused here,
        before any collective)."""
        if not local:
            rows = split_batch(rows, self.config.dp, self.mesh.rank("dp"))
        if self.tp_plan is not None:
            rows = self.tp_plan.shard_batch(rows)
        if self.sp_plan is not None:
            rows = self.sp_plan.shard_tokens(rows)
        return rows.to(self.mesh.device)

    def _global_mean(self, local: torch.Tensor) -> float:
        """Mean over dp, sp and tp of each rank's mean loss (tp ranks that share rows agree; sp ranks
        hold equal numbers of tokens, so the mean of their means is the mean over the whole sequence)."""
        local = local.reshape(1)
        comm.all_reduce(local, self.mesh, "dp", tag="loss")
        comm.all_reduce(local, self.mesh, "sp", tag="loss")
        comm.all_reduce(local, self.mesh, "tp", tag="loss")
        return local.item() / (self.config.dp * self.config.sp * self.config.tp)

    @contextmanager
    def _timed(self, name: str, kind: str, t0: float):
        """Record the enclosed work as one event of this step's timeline."""
        start = time.perf_counter() - t0
        yield
        self.events.append({"name": name, "kind": kind, "start": start, "end": time.perf_counter() - t0})

    @torch.no_grad()
    def evaluate(self, batch, *, local: bool | None = None) -> float:
        """Global mean loss of ``batch`` without training (global, or this rank's dp rows: ``train_step``)."""
        local = getattr(batch, "global_rows", None) is not None if local is None else bool(local)
        if self.pipeline is not None:
            return self.pipeline.evaluate(batch, local=local)
        inputs, targets = batch
        self.module.eval()
        self.count_targets(targets, 1, local)
        logits = self._logits(self.module(self._local_rows(inputs, local)))
        return self._global_mean(self.loss_fn(logits, self._local_rows(targets, local)))

    # ------------------------------------------------------------------ data
    def loader(self, dataset, batch_size: int, **kw):
        """A ``colab_kit.datasets.ShardedLoader`` over ``dataset`` for this engine: global batches of
        ``batch_size`` rows, this rank reading only its dp rows of each; ``engine.save``/``load`` carry its
        position, so a resumed run sees the same batches. ``kw``: ``shuffle``, ``seed``, ``drop_last``."""
        self._loader = ShardedLoader.for_engine(self, dataset, batch_size, **kw)
        return self._loader

    def fit(self, loader, steps: int, *, checkpoint=None, every: int | None = None, on_step=None) -> list[float]:
        """Train on ``loader`` until ``step_count == steps``, saving to ``checkpoint`` every ``every`` steps;
        started again after a rank died it continues from the last complete checkpoint there, to the
        losses of an uninterrupted run (``colab_kit.engine.fit``)."""
        return fit(self, loader, steps, checkpoint=checkpoint, every=every, on_step=on_step)

    def use_loader(self, loader) -> None:
        """Make ``loader`` (a ``ShardedLoader``) the one whose position checkpoints keep (``engine.fit`` does)."""
        self._loader = loader

    def loader_state(self) -> dict | None:
        """The position of the loader made by ``engine.loader`` (None without one): what a checkpoint keeps."""
        return self._loader.state_dict() if self._loader is not None else None

    def load_loader_state(self, state: dict | None) -> None:
        """Put the engine's loader where ``state`` says (nothing without a loader or a saved state)."""
        if self._loader is not None and state is not None:
            self._loader.load_state_dict(state)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> torch.Tensor:
        """Continue ``prompt_ids`` ``[b, t]`` (the same on every rank) by ``max_new_tokens`` tokens of this
        causal LM: greedy at ``temperature=0``, else sampled with a generator seeded by ``seed`` (the same
        draw on every rank). Returns ``[b, t + max_new_tokens]`` on every rank, equal token for token to
        the dense model generating in one process (``colab_kit.engine.generate``)."""
        return generate(self, prompt_ids, max_new_tokens, temperature=temperature, seed=seed)

    def throughput(self, last: int | None = None) -> dict:
        """Tokens per second, FLOPs per step, achieved FLOP/s and MFU over the recorded steps (the last
        ``last`` of them; the first step, which builds caches, is left out when there are more):
        see ``colab_kit.observe.throughput``."""
        return engine_throughput(self, last=last)

    def memory_timeline(self, batch, *, local: bool | None = None, **kw):
        """One train_step on ``batch`` with this rank's bytes by category over the step, the peak marked and
        what was alive at it: a ``colab_kit.memory.timeline.MemoryTimeline`` (every rank calls it). ``kw``:
        ``method`` ("auto": CUDA's allocator log on a GPU, after every op elsewhere), ``snapshot``, ``max_entries``."""
        return memory_timeline(self, batch, local=local, **kw)

    def roofline(self, constants: dict | None = None, peak: float | None = None, last: int | None = None):
        """Where the last step sits against the measured matmul peak and collective costs: compute- or
        communication-bound, and why (``colab_kit.observe.roofline.Roofline``)."""
        return roofline(self, constants, peak, last)

    def profile(self, batches, steps: int = 1, **kw):
        """``steps`` train_steps on ``batches`` under ``torch.profiler``: this rank's ``colab_kit.observe.profile.Profile``."""
        return profile(self, batches, steps, **kw)

    # ------------------------------------------------------------------ lifetime
    _loader = None
    step_peak = None  # engine.memory()["step_peak"]
    steps_run = 0
    """Steps this engine ran itself (``step_count`` also counts the ones a loaded checkpoint had run)."""
    lr_scheduler = None
    """The LR scheduler ``train_step`` steps after the optimizer (``boost(..., lr_scheduler=)``), or None."""
    max_grad_norm = None
    """The global gradient norm each step is clipped to (``boost(..., max_grad_norm=)``), or None."""
    _owns_mesh = False
    closed = False

    def close(self) -> None:
        """Release what this engine holds: the pipeline's hang monitor (its thread and store
        connection) and its hold on the shared mesh, whose process groups are destroyed when
        no other engine of the same config holds it. Idempotent; a closed engine does not train.
        An engine dropped without ``close()`` ends its threads when collected and gives its hold
        back at the next ``boost`` (``ProcessMesh.prune``), at the same point on every rank::

            for lr in (1e-3, 3e-3):                 # a sweep in one notebook: no groups or threads pile up
                engine = ck.boost(GPT(cfg), make_opt(lr), config)
                ...
                engine.close()
        """
        if self.closed:
            return
        if self.pipeline is not None:
            self.pipeline.close()
        self.grads.remove()  # the gradient hooks hold the buckets (and the mesh) from C++: gc cannot free them
        self.closed = True
        if self._owns_mesh:
            self.mesh.untrack(self)
            self.mesh.release()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"Engine({self.config.describe()}, rank {self.mesh.global_rank}, step {self.step_count}{state})"

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
(``colab_kit.sharded_init``), so no rank ever holds the whole model. ``engine.close()`` releases
the engine's hold on its mesh (shared by every engine of one config) and its threads.

What runs now: data parallelism (any dp) with gradient accumulation over
``config.microbatches``, composed with tensor parallelism (``colab_kit.tensor``)
and pipeline parallelism (``colab_kit.pipeline``: the model cut into ``pp * chunks``
stages, any schedule run by one executor, ``engine.pipeline`` to step it); ZeRO over dp
(``colab_kit.zero``: stages 1 and 2 build the optimizer over this rank's flat pieces,
reduce-scatter gradients and all-gather the updated pieces; stage 3 shards the parameters
in per-block chunks gathered around each use); ``offload`` "cpu" and "auto" (with
``device_budget``); mixed precision (``colab_kit.precision``); recomputation; sequence
parallelism (``colab_kit.sequence``: ring and Ulysses over the sp axis, split_gather inside the
1D tensor group). Sequence parallelism with the 2D/2.5D/3D tensor modes and ZeRO-3 with a
pipeline are refused with a ConfigError that says so (``unsupported``; every refusal is a part's rule,
the parts' rules (``engine.parts``), which the planner asks too); the engine never falls back to another mode.
"""
from __future__ import annotations

import warnings

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn as nn

from .. import checkpoint
from ..config import ConfigError, ParallelConfig
from ..datasets import ShardedLoader
from ..datasets.loader import LocalBatch
from ..mesh import ProcessMesh
from ..policy import Policy
from ..zero.optimizer import (OptimizerSpec, attach_scheduler, check_elementwise, check_scheduler, local_names,
                              rebuild)
from . import reports
from .checks import check_experts, check_policy, unsupported
from .fit import fit as _fit
from .generate import generate as _generate
from .loss import TokenLoss, lm_loss
from .options import BoostOptions
from .parallelize import parallelize
from .parts import first_refusal
from .step import TrainingStep

__all__ = ["boost", "BoostOptions", "Engine", "lm_loss", "unsupported", "check_policy", "check_experts", "TokenLoss"]


def boost(model: nn.Module, optimizer, config: ParallelConfig, *, policy=None,
          mesh: ProcessMesh | None = None, loss_fn: Callable = lm_loss, bucket_bytes: int | None = None,
          device_budget: int | None = None, max_grad_norm: float | None = None, lr_scheduler=None) -> Engine:
    """Shard ``model`` for ``config`` on this rank and return its ``Engine``.

    ``optimizer``: a ``torch.optim.Optimizer`` built over the dense ``model``'s parameters, with any param
    groups and per-group settings, rebuilt over this rank's shards (``colab_kit.zero.optimizer``); or a factory
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
    if config is None:
        raise ConfigError("boost needs a ck.ParallelConfig, got None: pass one, e.g. ck.ParallelConfig(dp=4); in a "
                          "%%colossal cell `config` is the cluster's, which %colossal config dp=4 (your degrees) sets, "
                          "and none is set yet")
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ck.ParallelConfig, got {type(config).__name__}")
    options = BoostOptions(policy, loss_fn, bucket_bytes, device_budget, max_grad_norm, lr_scheduler)
    options.check(config)  # each keyword once, here; then passed along as one object
    why = first_refusal(config)  # what no model changes, before the model and the optimizer are read
    if why is not None:
        raise why
    if not isinstance(model, nn.Module):
        raise TypeError(f"boost shards a torch.nn.Module, got {type(model).__name__}: e.g. "
                        "ck.boost(GPT(GPTConfig(...)), optimizer, config)")
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a colab_kit.policy.Policy, got {type(policy).__name__}: leave it out for "
                        "the built-in models (GPT, BERT, ViT) and the Hugging Face ones colab_kit knows, or "
                        "build one (help(colab_kit.policy) has a worked example)")
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
    options = replace(options, policy=check_policy(model, config, policy))  # every part's rules, in the kernel
    if mesh is not None and mesh.closed:
        raise ConfigError(f"the mesh given ({mesh.config.describe()}) was released (its last engine closed, or the "
                          "cluster's config changed since it was built): pass the cluster's current mesh, or leave "
                          "mesh= out")
    owned = mesh is None or mesh.hold()  # a shared mesh given (a cluster's) is held too: a new config keeps it
    mesh = mesh or ProcessMesh.shared(config)
    if mesh.config != config:
        if owned:
            mesh.release()
        raise ConfigError(f"the mesh was built for {mesh.config.describe()} but boost was given "
                          f"{config.describe()}: pass the same config to both")
    try:
        engine = Engine(model, spec if spec is not None else optimizer, config, mesh, options,
                        user_optimizer=optimizer if spec is not None else None)
    except BaseException:
        if owned:
            mesh.release()
        raise
    if owned:  # given back by close(); for an engine dropped without it, by the next boost (ProcessMesh.prune)
        mesh.track(engine)
        engine.owns_mesh = True
    return engine


class Engine:
    """One rank's share of a training job: ``parallelize``'s parts, the optimizer over them, the one step.

    ``engine.parts`` is what ``parallelize`` left (``colab_kit.engine.parallelize.Parallelized``),
    ``engine.step`` the training step (``colab_kit.engine.step.TrainingStep``): ``train_step`` is
    ``engine.step(batch)``; with a pipeline ``engine.step.begin/advance/finish`` step it by timesteps.
    """

    def __init__(self, model, optimizer, config, mesh, options: BoostOptions | None = None, *, user_optimizer=None):
        options = options if options is not None else BoostOptions()
        self.config, self.mesh, self.options = config, mesh, options
        """``options``: boost's keywords (``BoostOptions``), as checked."""
        self.traced: dict = {}
        """The memory estimate's dense trace of the activations, per global input shape (``reports``)."""
        self.current_loader: ShardedLoader | None = None
        """The ``ShardedLoader`` whose position checkpoints keep (``engine.loader`` / ``engine.fit`` set it)."""
        spec = optimizer if isinstance(optimizer, OptimizerSpec) else None
        group_of_name = spec.group_of if spec is not None and len(spec.hypers) > 1 else None
        self.parts = parallelize(model, mesh, config, options, group_of_name=group_of_name)
        self.optimizer, views, views_layout = self._build_optimizer(optimizer)
        scheduler = attach_scheduler(options.lr_scheduler, user_optimizer, self.optimizer)
        # the activations a step needs, for an offload's device account: a built-in model's from its config, any
        # other model with a policy from its dense forward traced on fake tensors (none for a model without one)
        known = self.model_cfg is not None or self.parts.policy is not None
        estimate = self._activations_estimate if known else None
        self.step = TrainingStep(self.parts, self.optimizer, lr_scheduler=scheduler,
                                 max_grad_norm=options.max_grad_norm, views=views, views_layout=views_layout,
                                 estimate_activations=estimate)
        """The training step: ``engine.step(batch)``; with pp, ``begin`` / ``advance`` / ``finish`` too."""

    def _activations_estimate(self) -> int:
        """The activations a step needs, for an offload's device account (``memory_estimate``); 0 with a warning
        where a model's forward cannot be traced on fake tensors (a kernel without a fake implementation): the
        account then holds what the steps measure, from the second step on."""
        try:
            return self.memory_estimate()["activations"]
        except Exception as e:  # noqa: BLE001 - an estimate only: the measurement takes over
            if not getattr(self, "_estimate_warned", False):
                self._estimate_warned = True
                warnings.warn(f"the activation estimate failed ({type(e).__name__}: {e}); offload reserves what "
                              "each step measures, from the second step on", stacklevel=2)
            return 0

    def _build_optimizer(self, optimizer):
        """The optimizer over what this rank steps (``data_parallel.optimizer_layout()``): a factory called with those
        tensors, or the user's optimizer rebuilt over them group by group (``colab_kit.zero.optimizer``);
        refused where parameters are cut (ZeRO, tp) unless it is elementwise. Returns it, its group views
        (a piece that spans param groups) and their layout."""
        dp = self.parts.data_parallel
        views, layout = None, None
        if isinstance(optimizer, OptimizerSpec):
            opt, views, keys, layout = rebuild(optimizer, dp.optimizer_layout(), local_names(self.parts.module))
            dp.set_optimizer(opt, keys)
        else:  # the parameters, ZeRO's pieces, or their fp32 masters (ZeRO's build checks them)
            opt = dp.build_optimizer(optimizer)
        if self.config.tp > 1:  # (ZeRO's build checks its own; a user's optimizer was checked by boost)
            check_elementwise(opt, f"tensor parallelism ({self.config.tp_mode}) gives each rank a block of each matrix")
        return opt, views, layout

    # ------------------------------------------------------------------ what parallelize left
    module = property(lambda self: self.parts.module, doc="This rank's model (with pp: its stages).")
    policy = property(lambda self: self.parts.policy, doc="The policy the parts lowered, or None.")
    model_cfg = property(lambda self: self.parts.model_cfg, doc="The dense model's config, or None.")
    dense_twin = property(lambda self: self.parts.dense_twin, doc="The dense model on the meta device.")
    tp_plan = property(lambda self: self.parts.tp_plan, doc="The ``TensorPlan`` with tp > 1, else None.")
    sp_plan = property(lambda self: self.parts.sp_plan, doc="The ``SequencePlan`` with sp > 1, else None.")
    device_budget = property(lambda self: self.options.device_budget,
                             doc="offload='auto': the bytes each rank's device may hold; else None.")
    data_parallel = property(lambda self: self.parts.data_parallel,
                             doc="The data-parallel part: plain dp (``DataParallel``) or ZeRO 1-3.")
    grads = property(lambda self: self.parts.data_parallel,
                     doc="``engine.data_parallel`` under its earlier name (kept for code written against it).")
    placement_table = property(lambda self: self.parts.placement_table,
                               doc="Each parameter's placement on the mesh in DTensor's terms.")
    events = property(lambda self: self.parts.events, doc="The last step's timeline events.")
    loss_fn = property(lambda self: self.parts.loss_fn, doc="The loss of a microbatch as this layout computes it.")
    # ------------------------------------------------------------------ what the step holds
    pipeline = property(lambda self: self.step.pipeline, doc="With pp > 1, this rank's ``PipelineExecutor``.")
    scaler = property(lambda self: self.step.scaler, doc="fp16: the dynamic loss scale, else None.")
    lr_scheduler = property(lambda self: self.step.lr_scheduler, doc="The LR scheduler stepped after the optimizer.")
    max_grad_norm = property(lambda self: self.step.max_grad_norm, doc="The global norm each step is clipped to.")
    activation_meter = property(lambda self: self.step.meter, doc="What autograd held in the last step.")
    records = property(lambda self: self.step.records.steps, doc="One dict per train_step (``StepRecords.steps``).")
    history = property(lambda self: self.step.records.history, doc="The global mean loss of every step run here.")
    steps_run = property(lambda self: self.step.records.run, doc="Steps this engine ran itself.")

    @property
    def step_count(self) -> int:
        """Steps taken, those of a loaded checkpoint included."""
        return self.step.records.count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.step.records.count = value

    @property
    def step_peak(self) -> int | None:
        """The most bytes held at once in the last step, where something measured it (``memory()``)."""
        return self.step.records.peak

    @step_peak.setter
    def step_peak(self, value: int | None) -> None:
        self.step.records.peak = value

    # ------------------------------------------------------------------ training
    def train_step(self, batch, *, local: bool | None = None) -> float:
        """One optimizer step on ``batch`` ``(inputs, targets)``; returns the global mean loss.

        ``batch`` is the global batch (the same on every rank), or with ``local=True`` this rank's dp share
        of it (rows ``r*B/dp .. (r+1)*B/dp`` on dp rank r, the same on the ranks of one dp coordinate): what
        ``engine.loader(...)`` yields (a ``LocalBatch``, recognised without ``local=``) or a ``DataLoader``
        with a ``DistributedSampler`` over the dp size and rank. The loss is the global batch's either way."""
        if self.closed:
            raise RuntimeError("this engine was closed (engine.close()): boost a new one to train again")
        local = isinstance(batch, LocalBatch) if local is None else bool(local)
        if self.mesh.device.type != "cuda":
            return self.step(batch, local)
        torch.cuda.reset_peak_memory_stats(self.mesh.device)  # engine.memory()["step_peak"]: the allocator's
        value = self.step(batch, local)
        self.step_peak = torch.cuda.max_memory_allocated(self.mesh.device)
        return value

    def evaluate(self, batch, *, local: bool | None = None) -> float:
        """Global mean loss of ``batch`` without training (global, or this rank's dp rows: ``train_step``)."""
        return self.step.evaluate(batch, isinstance(batch, LocalBatch) if local is None else bool(local))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> torch.Tensor:
        """Continue ``prompt_ids`` ``[b, t]`` (the same on every rank) by ``max_new_tokens`` tokens of this
        causal LM: greedy at ``temperature=0``, else sampled with a generator seeded by ``seed`` (the same
        draw on every rank). Returns ``[b, t + max_new_tokens]`` on every rank, equal token for token to
        the dense model generating in one process (``colab_kit.engine.generate``)."""
        return _generate(self, prompt_ids, max_new_tokens, temperature=temperature, seed=seed)

    # ------------------------------------------------------------------ data
    def loader(self, dataset, batch_size: int, **kw):
        """A ``colab_kit.datasets.ShardedLoader`` over ``dataset`` for this engine: global batches of
        ``batch_size`` rows, this rank reading only its dp rows of each; ``engine.save``/``load`` carry its
        position, so a resumed run sees the same batches. ``kw``: ``shuffle``, ``seed``, ``drop_last``."""
        self.current_loader = ShardedLoader.for_engine(self, dataset, batch_size, **kw)
        return self.current_loader

    def fit(self, loader, steps: int, *, checkpoint=None, every: int | None = None, on_step=None) -> list[float]:
        """Train on ``loader`` until ``step_count == steps``, saving to ``checkpoint`` every ``every`` steps;
        started again after a rank died it continues from the last complete checkpoint there, to the
        losses of an uninterrupted run (``colab_kit.engine.fit``)."""
        return _fit(self, loader, steps, checkpoint=checkpoint, every=every, on_step=on_step)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path, extra: dict | None = None) -> None:
        """A sharded checkpoint of this engine at ``path`` (every rank calls it), written atomically;
        ``extra``: a dict saved with it and returned by ``load`` (see ``colab_kit.checkpoint``)."""
        checkpoint.save(self, path, extra)

    def load(self, path) -> dict:
        """Load a checkpoint saved by an engine of any config (same model) and continue from its
        step; returns the ``extra`` dict given to ``save`` (see ``colab_kit.checkpoint``)."""
        return checkpoint.load(self, path)

    # ------------------------------------------------------------------ records
    def memory(self) -> dict:
        """Measured bytes on this rank by category and place (``colab_kit.engine.reports.memory``)."""
        return reports.memory(self)

    def memory_estimate(self) -> dict:
        """The estimate of ``memory()`` beside it, the one ``ck.plan`` ranks by (``reports.memory_estimate``)."""
        return reports.memory_estimate(self)

    def comm(self, last_step: bool = False) -> list[dict]:
        """This rank's recorded collectives (all, or those of the last step)."""
        return reports.comm(self, last_step)

    def timeline(self) -> list[dict]:
        """This rank's events of the last step: name, kind (compute/comm), start and end in seconds."""
        return reports.timeline(self)

    # ------------------------------------------------------------------ lifetime
    owns_mesh = False
    """Whether this engine holds its mesh (``boost`` made it): ``close()`` gives the hold back."""
    closed = False

    def close(self) -> None:
        """Release what this engine holds: the pipeline's hang monitor (its thread and store
        connection) and its hold on the shared mesh, whose process groups are destroyed when
        no other engine of the same config holds it. Idempotent; a closed engine does not train.
        The user's model gets back what tied it to this run (``Parallelized.restore``: the sequence plan's
        attention and positions, the dropout numbering); its shards stay as the parts cut them.
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
        self.data_parallel.remove()  # the gradient hooks hold the buckets (and the mesh) from C++: gc cannot free them
        self.parts.restore()  # the user's attentions, positions and dropouts as they were
        self.closed = True
        if self.owns_mesh:
            self.mesh.untrack(self)
            self.mesh.release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return f"Engine({self.config.describe()}, rank {self.mesh.global_rank}, step {self.step_count}{state})"

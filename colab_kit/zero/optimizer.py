"""The user's optimizer and LR scheduler, rebuilt over this rank's shards (``ck.boost(model, optimizer, ...)``).

A user builds the optimizer of a one-process recipe over the *dense* model, param groups and all::

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]      # matrices
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]        # biases and norms
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    engine = ck.boost(model, opt, cfg, lr_scheduler=sched, max_grad_norm=1.0)

``OptimizerSpec.capture`` reads from ``opt`` what survives sharding: its class, its defaults, and per
group its hyperparameters and the *dense names* of its parameters (every name of a tied one). The
engine then shards the model, and ``rebuild`` makes an optimizer of the same class over what this
rank steps (``grads.optimizer_layout()``: whole parameters or their tp shards, ZeRO's flat pieces, or
their fp32 masters), each tensor in the group its elements came from. A ZeRO piece holds elements of
several parameters; the engine orders each bucket (or chunk) by group, so a piece is at most one run
per group, and a piece that spans two groups is stepped as one view per group (``GroupViews``, bound
to the piece's storage and gradient before every step). So every group keeps its own weight decay and
learning rate under every config, the same as ``opt`` over the dense model.

Worked example, ZeRO-1 with dp=2, one bucket of a block holding ``fc.weight`` (12 elements, group 0)
and ``fc.bias`` and ``ln.weight`` (3 + 3, group 1), ordered by group::

    bucket          [ fc.weight 0..11 | fc.bias 12..14 | ln.weight 15..17 ]   18 elements
    rank 0 piece    [0, 9)   -> one tensor, all group 0 (weight decay 0.1)
    rank 1 piece    [9, 18)  -> view [0, 3) in group 0, view [3, 9) in group 1 (weight decay 0.0)

The scheduler is the user's own object, pointed at the engine's optimizer (``engine.lr_scheduler is
sched``); ``train_step`` steps it once per step, after the optimizer (fp16's skipped steps too, as a
torch loop with ``GradScaler`` does), and ``engine.save``/``load`` carry its state. A scheduler that
needs a metric (``ReduceLROnPlateau``) is the user's to step: build it over ``engine.optimizer``.

Elementwise only, where parameters are cut: under ZeRO (flat pieces of several parameters) or tensor
parallelism (a rank holds a block of a matrix), an optimizer that reads whole-parameter norms or
shapes (LAMB, LARS, Adafactor, Muon, LBFGS) would compute them over pieces: refused with
``ConfigError``, as is an optimizer class not known to be elementwise until it is declared so
(``elementwise(MyOptimizer)``). Under plain dp, pp and sp every rank steps whole parameters, and any
optimizer runs.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..config import ConfigError

__all__ = ["OptimizerSpec", "GroupViews", "rebuild", "local_names", "elementwise", "check_elementwise",
           "check_scheduler", "attach_scheduler", "ELEMENTWISE", "WHOLE_PARAMETER"]

ELEMENTWISE: set = {getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                                                      "Adadelta", "RMSprop", "Rprop", "ASGD")
                    if hasattr(torch.optim, n)}
"""Optimizer classes whose update of an element reads that element's gradient and history only."""

WHOLE_PARAMETER: tuple = tuple(getattr(torch.optim, n) for n in ("LBFGS", "SparseAdam", "Adafactor", "Muon")
                               if hasattr(torch.optim, n))
"""torch optimizers that need whole parameters (shapes, norms, a closure, sparse gradients)."""


def elementwise(cls: type) -> type:
    """Declare a user's optimizer class elementwise, so ZeRO and tensor parallelism may step it on
    pieces (usable as a class decorator): only if its update of each element depends on that
    element alone."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"elementwise() takes a torch.optim.Optimizer subclass, got {cls!r}")
    ELEMENTWISE.add(cls)
    return cls


def check_elementwise(optimizer, why: str) -> None:
    """Refuse ``optimizer`` (an optimizer or its class) where parameters are cut (``why``: "ZeRO steps
    flat pieces ...")."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    kind = cls.__name__
    if issubclass(cls, WHOLE_PARAMETER):
        raise ConfigError(f"{why}, and {kind} needs whole parameters (their shapes, norms or a closure): use an "
                          "elementwise optimizer such as AdamW or SGD, or a config without ZeRO and tensor "
                          "parallelism")
    if not issubclass(cls, tuple(ELEMENTWISE)):
        raise ConfigError(f"{why}, and {kind} is not known to be elementwise: one that reads per-parameter norms or "
                          f"shapes (LAMB, LARS, Adafactor) would compute them over pieces and step differently than "
                          f"one process. If its update of each element depends on that element only, declare it: "
                          f"colab_kit.zero.optimizer.elementwise({kind})")


def local_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the dense model: a pipeline stage's ``source_names``, else the module's."""
    stages: list = list(module) if isinstance(module, nn.ModuleList) else []  # pipeline stages, if these are
    if stages and all(hasattr(st, "source_names") for st in stages):
        return {id(p): n for st in stages for p, n in zip(st.parameters(), st.source_names)}
    return {id(p): n for n, p in module.named_parameters()}


class OptimizerSpec:
    """What ``rebuild`` needs of a user's optimizer over the dense ``model``: ``kind`` (its class),
    ``defaults``, ``hypers`` (each group's settings without its parameters) and ``group`` (dense
    parameter name -> group index, every name of a tied parameter)."""

    def __init__(self, kind: type, defaults: dict, hypers: list[dict], group: dict[str, int]):
        self.kind, self.defaults, self.hypers, self.group = kind, defaults, hypers, group

    @classmethod
    def capture(cls, optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerSpec:
        """Read ``optimizer`` (built over ``model``'s parameters); refuse one that has stepped, one over
        tensors that are not the model's parameters, or one that leaves a trainable parameter out."""
        if optimizer.state:
            raise ConfigError("boost takes a fresh optimizer (this one has states: it has stepped); to continue a "
                              "run, boost a new optimizer and engine.load(checkpoint)")
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        group, hypers = {}, []
        for g, pg in enumerate(optimizer.param_groups):
            for p in pg["params"]:
                if id(p) not in names:
                    raise ConfigError(f"param group {g} of the optimizer holds a tensor of shape {tuple(p.shape)} "
                                      f"that is not a parameter of the model given to boost: build the optimizer over "
                                      f"model.parameters() (or groups of them) of that same model")
                for n in names[id(p)]:
                    group[n] = g
            hypers.append({k: v for k, v in pg.items() if k not in ("params", "param_names")})  # names: dense ones
        left = sorted(n for n, p in model.named_parameters() if p.requires_grad and n not in group)
        if left:
            raise ConfigError(f"the optimizer leaves out trainable parameters ({', '.join(left[:4])}"
                              f"{', ...' if len(left) > 4 else ''}): put every parameter in a param group, or freeze "
                              f"the others with p.requires_grad_(False) before boost")
        return cls(type(optimizer), dict(optimizer.defaults), hypers, group)

    def group_of(self, name: str) -> int:
        if name not in self.group:
            raise RuntimeError(f"colab_kit.zero.optimizer: {name} is in no param group of the user's optimizer")
        return self.group[name]


class GroupViews:
    """Tensors the optimizer steps that are views of a piece (one per group it spans): ``bind()`` points
    each at its piece's current storage and gradient (the piece may have moved, its gradient been
    replaced); the engine calls it before every step."""

    def __init__(self):
        self.views: list[tuple[nn.Parameter, torch.Tensor, int, int]] = []

    def add(self, base: torch.Tensor, lo: int, hi: int) -> nn.Parameter:
        v = nn.Parameter(base.data.reshape(-1)[lo:hi])
        self.views.append((v, base, lo, hi))
        return v

    def bind(self) -> None:
        for v, base, lo, hi in self.views:
            v.data = base.data.reshape(-1)[lo:hi]
            g = base.grad
            v.grad = None if g is None else g.reshape(-1)[lo:hi]

    def release(self) -> None:
        """After a step: drop the views' gradients (slices that would keep a dropped fp32 gradient alive) and
        point them at their pieces' storage now (a chunk offload moved keeps no old copy alive)."""
        for v, base, lo, hi in self.views:
            v.grad = None
            v.data = base.data.reshape(-1)[lo:hi]

    def __len__(self) -> int:
        return len(self.views)


def _segments(t: torch.Tensor, runs, spec: OptimizerSpec, names: dict[int, str]) -> list[tuple[int, int, int]]:
    """``(group, lo, hi)`` covering ``t`` (flat), one per run of consecutive elements of one group; padding
    goes with the run before it (or the first run)."""
    marks = sorted((at, spec.group_of(names[id(p)])) for p, _start, _length, at in runs)
    if not marks:
        return [(0, 0, t.numel())]
    starts: list[tuple[int, int]] = []  # (group, where its run starts)
    for at, g in marks:
        if starts and starts[-1][0] == g:
            continue
        starts.append((g, at if starts else 0))
    return [(g, lo, starts[i + 1][1] if i + 1 < len(starts) else t.numel()) for i, (g, lo) in enumerate(starts)]


def rebuild(spec: OptimizerSpec, layout, names: dict[int, str]):
    """An optimizer of ``spec.kind`` over this rank's tensors ``layout`` (``grads.optimizer_layout()``), every
    element in the group its parameter is in. Returns ``(optimizer, views, keys, view_layout)``: ``views``
    (``GroupViews``) to bind before each step, ``keys[i]`` the tensors stepped for ``layout[i]`` (the
    optimizer's state keys), ``view_layout`` the layout of the tensors the optimizer steps (for checkpoints)."""
    groups: list[list[torch.Tensor]] = [[] for _ in spec.hypers]
    views, keys, view_layout = GroupViews(), [], []
    for t, runs in layout:
        segs = _segments(t, runs, spec, names)
        if len(segs) == 1:
            groups[segs[0][0]].append(t)
            keys.append([t])
            view_layout.append((t, runs))
            continue
        mine = []
        for g, lo, hi in segs:
            v = views.add(t, lo, hi)
            groups[g].append(v)
            mine.append(v)
            inside = []
            for p, start, length, at in runs:
                a, b = max(at, lo), min(at + length, hi)
                if a < b:
                    inside.append((p, start + a - at, b - a, a - lo))
            view_layout.append((v, inside))
        keys.append(mine)
    views.bind()
    params = [{"params": ps, **h} for ps, h in zip(groups, spec.hypers)]
    import inspect
    sig = inspect.signature(spec.kind).parameters  # its __init__'s, less self
    takes_all = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in sig.values())
    kwargs = {k: v for k, v in spec.defaults.items() if takes_all or k in sig}  # (AdamW's defaults hold more)
    try:
        optimizer = spec.kind(params, **kwargs)
    except TypeError as e:
        raise ConfigError(f"could not build {spec.kind.__name__} again over this rank's shards ({e}): pass a factory "
                          f"instead, boost(model, lambda params: {spec.kind.__name__}(params, ...), cfg)") from e
    for pg, h in zip(optimizer.param_groups, spec.hypers):
        pg.update(h)  # exactly the user's values (an initial_lr a scheduler set, a tensor lr)
    return optimizer, views, keys, view_layout


# ---------------------------------------------------------------------- the scheduler
def _schedulers(sched) -> list:
    """``sched`` and the schedulers inside it (``SequentialLR``, ``ChainedScheduler``)."""
    out = [sched]
    for s in getattr(sched, "_schedulers", None) or ():
        out += _schedulers(s)
    return out


def _track_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's schedulers do when built over it, so their first ``step`` knows
    the optimizer stepped before it (else torch warns that the order is wrong)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    # torch's own marks (torch.optim.lr_scheduler), which its types do not declare
    def wrapper(*args, **kwargs):
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


_BOOSTED: weakref.WeakSet = weakref.WeakSet()
"""The LR schedulers given to a ``boost`` already (each drives that engine's optimizer from then on)."""


def check_scheduler(lr_scheduler, user_optimizer) -> None:
    """Refuse, before any process is touched, a scheduler ``boost`` cannot step: one over another optimizer
    than ``user_optimizer`` (None: boost was given a factory), one that steps on a metric, or not a scheduler."""
    if lr_scheduler is None:
        return
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    if isinstance(lr_scheduler, ReduceLROnPlateau):
        raise ConfigError("ReduceLROnPlateau steps on a metric, which train_step does not know: build it after boost "
                          "over engine.optimizer and call its step(metric) yourself")
    if isinstance(lr_scheduler, LRScheduler):
        if user_optimizer is None:
            raise ConfigError("lr_scheduler was built over an optimizer, but boost was given an optimizer factory: "
                              "pass the optimizer itself, or lr_scheduler=lambda opt: LambdaLR(opt, f)")
        for s in _schedulers(lr_scheduler):
            if s in _BOOSTED:
                raise ConfigError(f"this lr_scheduler ({type(s).__name__}) was given to a boost already and drives "
                                  "that engine's optimizer now: build a new optimizer and scheduler for another engine")
            if s.optimizer is not user_optimizer:
                raise ConfigError(f"lr_scheduler ({type(s).__name__}) was built over another optimizer than the one "
                                  f"given to boost: build it over that optimizer")
        return
    if not callable(lr_scheduler):
        raise ConfigError(f"lr_scheduler must be a torch.optim.lr_scheduler scheduler built over the optimizer, a "
                          f"function optimizer -> scheduler, or None; got {type(lr_scheduler).__name__}")


def attach_scheduler(lr_scheduler, user_optimizer, optimizer):
    """The scheduler ``train_step`` steps, over the engine's ``optimizer``: the user's object pointed at it
    (it was built over ``user_optimizer``: ``check_scheduler``), or ``lr_scheduler(optimizer)`` for a
    factory; None for None."""
    if lr_scheduler is None:
        return None
    from torch.optim.lr_scheduler import LRScheduler
    check_scheduler(lr_scheduler, user_optimizer)
    if isinstance(lr_scheduler, LRScheduler):
        for s in _schedulers(lr_scheduler):
            s.optimizer = optimizer
            _BOOSTED.add(s)
        _track_steps(optimizer)
        return lr_scheduler
    sched = lr_scheduler(optimizer)
    if not isinstance(sched, LRScheduler) or any(s.optimizer is not optimizer for s in _schedulers(sched)):
        raise ConfigError("lr_scheduler(optimizer) must return a torch LR scheduler over the optimizer it is given")
    return sched

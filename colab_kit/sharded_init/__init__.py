"""Sharded initialisation: each rank builds only its own shards of a model made on the meta device.

A dense ``GPT(cfg)`` costs every rank the whole model before ``boost`` slices it. Made on
the meta device instead (shapes, no storage), the model costs nothing, and ``boost`` builds
on each rank exactly the values a dense ``GPT(cfg)`` would hold, one parameter at a time::

    model = GPT(cfg, device="meta")        # or: with torch.device("meta"): model = GPT(cfg)
    engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=3e-4), config)

Three steps, all inside ``boost``:

1. ``defer(model)`` gives each meta tensor its recipe: the model's
   ``init_parameter`` and the tensor's name (``GPT.init_parameter`` draws from a generator
   seeded with ``(cfg.seed, name)``, so a parameter can be made alone). With pp > 1 only the
   tensors of this rank's pipeline stages get one (``pipeline.stage.defer_stages``): the rest stay
   meta, cost nothing, and the pipeline split drops them.
2. The tensor plan's ``from_dense`` constructors cut each dense weight through ``cut(t, fn)``: a
   real tensor's shard is made now; a meta one's stays meta, with a recipe of its own (make ``t``
   whole on the CPU, keep ``fn`` of it, drop the whole), so nothing is made yet.
3. ``materialize(module)``, after the plan and the pipeline split, makes in place whatever is
   still meta, one tensor at a time: every shard the plan cut, what it leaves whole (1D's LayerNorms
   and position table), or everything when tp = 1. Under ZeRO-3 the trainable tensors stay meta
   here (``materialize(module, keep=...)``): ZeRO-3's chunks make only this rank's dp (x sp) piece of each
   (``colab_kit.zero.chunks``), so a rank never holds its whole tp/pp share either.

So a rank's memory peaks at its own shards plus the largest single dense parameter (and
that parameter's shard while it is being cut). A Hugging Face model has no ``init_parameter``:
``defer`` gives it ``colab_kit.sharded_init.hf.recipe`` (transformers' own ``_init_weights`` per module,
seeded by the tensor's name), and ``fill(model)`` gives a dense model the same values (the one-process
reference of a run built on meta). The engine's dp broadcast of the initial
parameters still runs afterwards: it is redundant here, since every rank makes the same
values, but it keeps one starting point for a dense model built with the wrong seed.

Worked example, ``ParallelConfig(tp=2)`` (1D) and
``GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=1)``, 17,376
parameters (69,504 bytes) in the dense model. The tensor plan cuts every matrix (still meta),
then ``materialize`` makes each tensor in the model's order (a module's weight before its bias)::

    tensor made whole          rank 0 keeps             rank 1 keeps
    tok.weight    [64, 32]     rows 0..31 (tokens)      rows 32..63
    pos.weight    [16, 32]     all of it                all of it
    ln1 (weight, bias)         all of it                all of it
    qkv.weight    [96, 32]     rows 0..47 (heads 0-1)   rows 48..95 (heads 2-3)
    qkv.bias      [96]         0..47                    48..95
    proj.weight   [32, 32]     columns 0..15            columns 16..31
    proj.bias     [32]         all of it                all of it
    ln2 (weight, bias)         all of it                all of it
    fc1.weight    [128, 32]    rows 0..63               rows 64..127
    fc1.bias      [128]        0..63                    64..127
    fc2.weight    [32, 128]    columns 0..63            columns 64..127
    fc2.bias      [32]         all of it                all of it
    ln_f (weight, bias)        all of it                all of it
    head.weight   [64, 32]     rows 0..31 (vocabulary)  rows 32..63

Each rank ends with 9,072 parameters (36,288 bytes); its peak is while ``fc2.weight`` is
being cut: 5,904 kept so far + 4,096 whole + 2,048 of shard = 12,048 floats (48,192 bytes, as
``tests/ranks/test_sharded_init.py`` measures), against 69,504 for the dense model.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from .hf import recipe

__all__ = ["defer", "dense_value", "cut", "adopt", "materialize", "meta_twin", "placeholder", "unmade",
           "has_recipe", "fill"]

_RECIPES = WeakIdKeyDictionary()
"""Per meta tensor, ``make() -> CPU tensor``: how to make its dense value (kept here, not on the tensor)."""
_BASES: dict[int, torch.Tensor] = {}
"""Each tensor ``defer`` gave a recipe, by its storage, until ``adopt``: a view of it made later (GPT-2's Conv1D
weight transposed into an ``nn.Linear``'s) is made from it (``_recipe``)."""
_CUTS: dict[int, tuple[torch.Tensor, Callable]] = {}
"""A meta shard ``cut`` made, by its storage (``nn.Parameter(shard)`` is a new object on the same storage):
``(the shard, make)``, until ``adopt`` files it under the parameter that holds it."""


def _init_recipe(init, name: str, shape, dtype) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        with torch.no_grad():
            init(name, out)
        return out
    return make


def _resolve_init(model: nn.Module):
    init = getattr(model, "init_parameter", None)
    if init is None and hasattr(model, "_init_weights") and hasattr(model, "config"):  # transformers' model
        init = recipe(model, meta_twin(model))
    if init is None:
        raise TypeError(f"{type(model).__name__} was built on the meta device but has no "
                        f"init_parameter(name, tensor) to make its values: build it on a real device, "
                        f"or give it one (see ck.models.GPT.init_parameter)")
    return init


def defer(model: nn.Module, keep=None) -> bool:
    """Give each meta parameter and buffer of ``model`` its recipe (``model.init_parameter(name, tensor)``,
    made in the dtype it has now, so a later cast to 16 bits rounds the fp32 values as a dense model's
    would); return whether there were any (False: a dense model, nothing to do).

    ``keep``: the modules whose tensors get one (a pipeline rank's stages, as
    ``colab_kit.pipeline.stage.defer_stages`` passes them), so the tensor plan makes no shard of another
    rank's stage (its layers are cut, still meta); None: every meta tensor.
    """
    names: dict[str, torch.Tensor] = dict(model.named_parameters())
    names.update(model.named_buffers())
    meta = {name: t for name, t in names.items() if t.is_meta}
    if not meta:
        return False
    init = _resolve_init(model)
    mine = None if keep is None else {id(t) for s in keep for t in (*s.parameters(), *s.buffers())}
    for name, t in meta.items():  # (one given earlier stays: GPT-2's Conv1D weights, before they became Linear)
        if (mine is None or id(t) in mine) and not has_recipe(t):
            _RECIPES[t] = _init_recipe(init, name, t.shape, t.dtype)
            if t.is_contiguous() and t.storage_offset() == 0:
                _BASES[t.untyped_storage()._cdata] = t
    return True


def _recipe(t: torch.Tensor) -> Callable | None:
    recipe = _RECIPES.get(t)
    if recipe is None and t.is_meta:
        key = t.untyped_storage()._cdata
        entry = _CUTS.get(key)
        recipe = entry[1] if entry is not None and entry[0].shape == t.shape else None
        base = _BASES.get(key)
        if recipe is None and base is not None and base is not t and _RECIPES.get(base) is not None:
            recipe = _view_recipe(_RECIPES[base], t)
    return recipe


def _view_recipe(make_base: Callable, view: torch.Tensor) -> Callable:
    """A view of a tensor with a recipe (same storage, its own shape and strides): the base made, the view read."""
    shape, stride, offset = tuple(view.shape), view.stride(), view.storage_offset()

    def make() -> torch.Tensor:
        return make_base().as_strided(shape, stride, offset).clone(memory_format=torch.contiguous_format)
    return make


def has_recipe(t: torch.Tensor) -> bool:
    return _recipe(t) is not None


def dense_value(t: torch.Tensor) -> torch.Tensor:
    """The dense value a parallel layer cuts its shard from: ``t`` itself when it is real (or meta
    with no recipe: another pipeline rank's, whose cut stays meta), else a fresh CPU tensor made
    by ``t``'s recipe, in ``t``'s dtype. The caller keeps only its slice, so one whole tensor is alive at a time."""
    recipe = _recipe(t)
    return t if recipe is None else _value(recipe, t.dtype)


def _value(recipe: Callable, dtype: torch.dtype) -> torch.Tensor:
    out = recipe()
    return out if out.dtype == dtype else out.to(dtype)


def cut(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(dense value of t)`` as a fresh contiguous tensor: this rank's shard of ``t`` (``fn`` slices,
    transposes, reorders). A real ``t``: made now. A meta ``t`` with a recipe: a meta shard whose recipe
    makes ``t`` and keeps ``fn`` of it (``materialize`` or ZeRO-3's chunks make it later, alone). A meta
    ``t`` without one (another pipeline rank's): a meta shard, nothing to make.

    Worked example, tp=2 rank 1, ``t`` a meta ``[96, 32]`` with a recipe: ``cut(t, lambda w: w.chunk(2)[1])``
    is a meta ``[48, 32]``; made later, it is rows 48..95 of the dense ``t``, and the whole ``[96, 32]`` lives
    only while it is being cut.
    """
    recipe = _recipe(t)
    shard = fn(t.detach()).clone(memory_format=torch.contiguous_format)
    if recipe is not None and t.is_meta:
        src_dtype = t.dtype

        def make() -> torch.Tensor:
            return fn(_value(recipe, src_dtype)).clone(memory_format=torch.contiguous_format)
        _CUTS[shard.untyped_storage()._cdata] = (shard, make)
    return shard


def adopt(module: nn.Module) -> None:
    """File every meta shard ``cut`` made under the tensor of ``module`` that holds it (its identity lasts
    through a later cast to 16 bits; its storage would not), and forget the rest."""
    for t in (*module.parameters(), *module.buffers()):
        if t.is_meta and t not in _RECIPES:
            recipe = _recipe(t)
            if recipe is not None:
                _RECIPES[t] = recipe
    _CUTS.clear()
    _BASES.clear()


@torch.no_grad()
def materialize(module: nn.Module, keep: Callable[[torch.Tensor], bool] | None = None) -> nn.Module:
    """Make every parameter and buffer of ``module`` still on the meta device, in place, from its
    recipe (one at a time); a tensor shared by several modules stays one tensor. A meta tensor without a
    recipe is an error that names it (nothing says what its values are). ``keep(t)``: leave ``t`` meta
    (ZeRO-3 makes its trainable tensors piece by piece)."""
    adopt(module)
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # keeps the meta one alive: ids stay unique
    for prefix, mod in module.named_modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta or (keep is not None and has_recipe(t) and keep(t)):
                    continue
                if id(t) not in made:
                    made[id(t)] = (t, _made(t, f"{prefix}.{name}" if prefix else name))
                table[name] = made[id(t)][1]
    return module


def _made(t: torch.Tensor, where: str) -> torch.Tensor:
    value = dense_value(t)
    if value.is_meta:
        raise ValueError(f"{where} is on the meta device and has no recipe to make it: "
                         "pass the model to ck.boost, which gives every meta tensor one "
                         "(colab_kit.sharded_init.defer)")
    if not isinstance(t, nn.Parameter):
        return value
    p = nn.Parameter(value, requires_grad=t.requires_grad)
    p.__dict__.update(t.__dict__)
    return p


def placeholder(t: nn.Parameter, device) -> nn.Parameter:
    """A real parameter on ``device`` shaped like the meta ``t``, with no bytes yet and ``t``'s recipe:
    what ZeRO-3 makes a chunk from (``unmade``), its values written piece by piece."""
    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
    empty.untyped_storage().resize_(0)
    p = nn.Parameter(empty, requires_grad=t.requires_grad)
    p.__dict__.update(t.__dict__)
    _RECIPES[p] = _recipe(t)
    return p


def unmade(t: torch.Tensor) -> bool:
    """A placeholder: real, no bytes, a recipe (``placeholder``)."""
    return not t.is_meta and t.untyped_storage().nbytes() == 0 and t.numel() > 0 and t in _RECIPES


def forget(t: torch.Tensor) -> None:
    _RECIPES.pop(t, None)


@torch.no_grad()
def fill(model: nn.Module, names=None) -> nn.Module:
    """Write into a dense (real) ``model`` the values its meta twin gets from ``ck.boost``: each parameter
    and buffer (``names``: only those) by the recipe ``defer`` would give it. The one-process reference of a
    run built on meta, for a model whose own construction draws differently (a Hugging Face model)."""
    init = _resolve_init(model)
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name, t in tensors.items():
        if names is None or name in names:
            t.copy_(_init_recipe(init, name, t.shape, t.dtype)())
    return model


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device (shapes, no storage; tied parameters stay tied), made before
    the engine shards it: the dense names and shapes the checkpoint maps elements to (``checkpoint.layout``),
    whatever the model."""
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        twin = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin
    return copy.deepcopy(model, memo)

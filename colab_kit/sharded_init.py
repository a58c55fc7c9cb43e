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
2. The tensor plan's ``from_dense`` constructors read each dense weight through
   ``dense_value(p)``: a real tensor comes back as it is; a meta one with a recipe is made
   whole on the CPU, the layer clones its shard out of it, and the whole one is dropped
   before the next parameter is made.
3. ``materialize(module)``, after the plan and the pipeline split, makes in place whatever is
   still meta: what the tensor plan leaves whole (1D's LayerNorms and position table), or
   everything when tp = 1.

So a rank's memory peaks at its own shards plus the largest single dense parameter (and
that parameter's shard while it is being cut). The engine's dp broadcast of the initial
parameters still runs afterwards: it is redundant here, since every rank makes the same
values, but it keeps one starting point for a dense model built with the wrong seed.

Worked example, ``ParallelConfig(tp=2)`` (1D) and
``GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=1)``, 17,376
parameters (69,504 bytes) in the dense model. Layer by layer (a Linear's bias just before its
weight), each rank makes::

    tensor made whole          rank 0 keeps             rank 1 keeps
    tok.weight    [64, 32]     rows 0..31 (tokens)      rows 32..63
    qkv.weight    [96, 32]     rows 0..47 (heads 0-1)   rows 48..95 (heads 2-3)
    qkv.bias      [96]         0..47                    48..95
    proj.weight   [32, 32]     columns 0..15            columns 16..31
    proj.bias     [32]         all of it                all of it
    fc1.weight    [128, 32]    rows 0..63               rows 64..127
    fc1.bias      [128]        0..63                    64..127
    fc2.weight    [32, 128]    columns 0..63            columns 64..127
    fc2.bias      [32]         all of it                all of it
    head.weight   [64, 32]     rows 0..31 (vocabulary)  rows 32..63
    then materialize: pos.weight [16, 32], ln1, ln2, ln_f (weight and bias), whole on both

Each rank ends with 9,072 parameters (36,288 bytes); its peak is while ``fc2.weight`` is
being cut: 5,296 kept so far (fc2's bias, made just before its weight, included) + 4,096
whole + 2,048 of shard = 11,440 floats (45,760 bytes, as ``tests/ranks/test_sharded_init.py``
measures), against 69,504 for the dense model.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["defer", "dense_value", "materialize", "meta_twin"]

_RECIPES = WeakIdKeyDictionary()
"""Per meta tensor, ``(init_parameter, name)``: how to make its dense value (kept here, not on the tensor)."""


def defer(model: nn.Module, keep=None) -> bool:
    """Give each meta parameter and buffer of ``model`` its recipe, ``(model.init_parameter, name)``;
    return whether there were any (False: a dense model, nothing to do).

    ``keep``: the modules whose tensors get one (a pipeline rank's stages, as
    ``colab_kit.pipeline.stage.defer_stages`` passes them), so the tensor plan makes no shard of another
    rank's stage (its layers are cut, still meta); None: every meta tensor.
    """
    names: dict[str, torch.Tensor] = dict(model.named_parameters())
    names.update(model.named_buffers())
    meta = {name: t for name, t in names.items() if t.is_meta}
    if not meta:
        return False
    init = getattr(model, "init_parameter", None)
    if init is None:
        raise TypeError(f"{type(model).__name__} was built on the meta device but has no "
                        f"init_parameter(name, tensor) to make its values: build it on a real device, "
                        f"or give it one (see ck.models.GPT.init_parameter)")
    mine = None if keep is None else {id(t) for s in keep for t in (*s.parameters(), *s.buffers())}
    for name, t in meta.items():
        if mine is None or id(t) in mine:
            _RECIPES[t] = (init, name)
    return True


def dense_value(t: torch.Tensor) -> torch.Tensor:
    """The dense value a parallel layer cuts its shard from: ``t`` itself when it is real (or meta
    with no recipe: another pipeline rank's, whose cut stays meta), else a fresh CPU tensor made
    by ``t``'s recipe. The caller keeps only its slice, so one whole tensor is alive at a time."""
    recipe = _RECIPES.get(t) if t.is_meta else None
    if recipe is None:
        return t
    init, name = recipe
    out = torch.empty(t.shape, dtype=t.dtype)
    with torch.no_grad():
        init(name, out)
    return out


@torch.no_grad()
def materialize(module: nn.Module) -> nn.Module:
    """Make every parameter and buffer of ``module`` still on the meta device, in place, from its
    recipe; a tensor shared by several modules stays one tensor. A meta tensor without a recipe is
    an error that names it (nothing says what its values are)."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # keeps the meta one alive: ids stay unique
    for prefix, mod in module.named_modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
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


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device (shapes, no storage; tied parameters stay tied), made before
    the engine shards it: the dense names and shapes the checkpoint maps elements to (``checkpoint.layout``),
    whatever the model."""
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        twin = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin
    return copy.deepcopy(model, memo)

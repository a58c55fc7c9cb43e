"""Values for a Hugging Face model built on the meta device: transformers' own init, one tensor at a time.

``ck.boost`` makes a meta model's tensors from a recipe per tensor (``colab_kit.sharded_init``). The built-in
models have one (``GPT.init_parameter``); a ``transformers`` model has ``_init_weights(module)``, which draws
every tensor of a module from the global random generator in construction order, so no tensor could be
made alone. ``recipe(model)`` makes one: to make tensor ``name``, it copies the module that owns it (that
module alone, on the CPU, its children left meta), seeds the generator with ``(seed, name)``, runs the
model's ``_init_weights`` on the copy and then on each ancestor (children first, as transformers' own pass:
GPT-2's attention rescales its ``c_proj``), and returns the tensor. So the values follow transformers' rules for
each kind of module (N(0, initializer_range) matrices, norms at 1, rotary tables computed, a padding row
at zero) and depend on nothing but the name: every rank, and a dense copy written by
``colab_kit.sharded_init.fill``, get the same ones. A dense ``from_config`` model draws in another order,
so its values differ: a run built on meta is compared with ``fill(dense)``, not with ``from_config``.

The seed is 0 unless the model says otherwise (``model.colab_kit_seed = 3`` before ``boost``). A tensor that
``_init_weights`` leaves unwritten (a custom ``nn.Parameter`` the model's class does not initialise) is an
error naming it, not uninitialised memory.

Worked example, Llama with ``initializer_range=0.02``: ``recipe(model)("model.layers.0.mlp.up_proj.weight",
t)`` copies ``up_proj`` (an ``nn.Linear``), draws its weight from N(0, 0.02) under the seed of that name and
writes it into ``t``; ``"model.norm.weight"`` is all ones; ``"model.rotary_emb.inv_freq"`` the rotary table.
"""
from __future__ import annotations

import copy
import hashlib

import torch
import torch.nn as nn

__all__ = ["recipe"]


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little")


def recipe(model: nn.Module, frozen: nn.Module, seed: int | None = None):
    """``init_parameter(name, tensor)`` for a ``transformers`` model (see the module docstring); ``frozen``: a meta
    copy of it as it is now (``sharded_init.meta_twin``), whatever the engine later replaces or makes real in the
    model itself (a tensor plan's layers, ZeRO-3's placeholders, GPT-2's Conv1D)."""
    seed = getattr(model, "colab_kit_seed", 0) if seed is None else seed
    modules = dict(frozen.named_modules(remove_duplicate=False))
    init_weights = getattr(model, "_init_weights")  # noqa: B009 (nn.Module's typing says a tensor)
    owners = {f"{path}.{attr}" if path else attr: path for path, mod in modules.items()
              for attr in (*mod._parameters, *mod._buffers)}
    chains = {name: _ancestors(modules, path) for name, path in owners.items()}

    @torch.no_grad()
    def init_parameter(name: str, tensor: torch.Tensor) -> torch.Tensor:
        attr = name.rpartition(".")[2]
        owner = modules[owners[name]]
        twin = _alone(owner)
        made = getattr(twin, attr)
        if made.is_floating_point():
            made.fill_(float("nan"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed(seed, name))
            init_weights(twin)
            node = twin
            for ancestor, child in chains[name]:  # children before parents, as transformers' own pass runs:
                up = copy.copy(ancestor)           # a parent may redraw a child's tensor (GPT-2's scaled c_proj)
                up._modules = {**ancestor._modules, child: node}
                up.__dict__.pop("_is_hf_initialized", None)
                init_weights(up)
                node = up
        made = getattr(twin, attr)
        if made.is_floating_point() and bool(torch.isnan(made).any()):
            raise ValueError(f"{name}: {type(model).__name__}._init_weights does not initialise it "
                             f"({type(owner).__name__}.{attr}), so it cannot be made on its own: build the model "
                             "on a real device, or give it init_parameter(name, tensor)")
        return tensor.copy_(made)

    return init_parameter


def _ancestors(modules: dict, path: str) -> list[tuple[nn.Module, str]]:
    """``(ancestor, the child on the way down)`` from the module at ``path``'s parent up to the root."""
    out = []
    while path:
        parent, _, child = path.rpartition(".")
        out.append((modules[parent], child))
        path = parent
    return out


def _alone(owner: nn.Module) -> nn.Module:
    """A copy of ``owner`` with its own tensors real and empty on the CPU (children stay as they are: meta)
    and no transformers' "already initialised" marks."""
    twin = copy.copy(owner)  # shallow: the children are shared, never written
    twin._parameters = dict(twin._parameters)
    twin._buffers = dict(twin._buffers)
    tables: tuple[dict, dict] = (twin._parameters, twin._buffers)
    for table in tables:
        for key, t in table.items():
            if t is None:
                continue
            fresh = torch.empty(t.shape, dtype=t.dtype)
            table[key] = nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fresh
    twin.__dict__.pop("_is_hf_initialized", None)
    return twin

"""The dry-run process (``run_jobs``): each job built in turn as its rank of torch's fake process group, its
model's tensors given storage and no values (``_unwritten``), the optimizer stepped once on zero gradients, and
what the rank holds measured (``engine.memory()``, the activations by the engine's estimate). ``run.dry_run_many``
runs it in a child forked from a warm server (``launch.warm.fork_call``), its stderr in a log file."""
from __future__ import annotations

import os
import pickle
import sys
import time

from ...config import Axis
from ...engine.core import boost
from ...memory.estimator import config_estimate, gpt_like, model_activations
from ...memory.formulas import optimizer_states
from ...sharded_init import meta_twin
from .report import MEMORY_KEYS

__all__ = ["BIG", "run_jobs"]


def run_jobs(src: str, dst: str) -> None:
    """The dry-run process: each job in turn as its rank of the fake process group."""
    import traceback
    with open(src, "rb") as fh:
        sys.path[:] = pickle.load(fh)
        jobs = pickle.load(fh)
    out = []
    for j, job in enumerate(jobs):
        print(f"colab_kit dry run: job {j}", file=sys.stderr, flush=True)
        try:
            out.append(_one(job))
        except BaseException:  # noqa: BLE001 - reported with the rank that raised it
            out.append({"error": traceback.format_exc()})
            break
    with open(dst + ".tmp", "wb") as fh:
        pickle.dump(out, fh)
    os.replace(dst + ".tmp", dst)


def _no_values(name, tensor) -> None:
    """Each meta tensor's recipe in a dry run: leave its values unset (bytes do not depend on them)."""


BIG = 1 << 20
"""Elements from which a dry run's fills and copies give a tensor its storage and write nothing (``_unwritten``)."""


def _unwritten(stepping: bool = False):
    """A dispatch mode under which tensors of ``BIG`` elements or more get their storage and no values: a
    fill (``zeros``, ``full``, ``zero_``, ``fill_``) allocates or leaves the memory as it is, a ``copy_`` into
    one is skipped. The bytes a rank holds are what a dry run reports, counted by storage; its values
    are never read. Untouched pages are not resident, so a rank's flat buffers are not paid for in this
    process's memory or time: the 512-rank ZeRO-2 config of notebook 08 (a 406M GPT, ``ck.plan(...,
    exact=2)``) took 11 s and 3.5 GB resident before, most of it zeroing and copying the full flat buffers
    of params and grads (1.6 GB each). Other ops still write (``cat``, ``clone``, ``out=``; outside
    ``stepping``, below), and so do fills of smaller tensors (offsets, indices, counters). A
    ``torch.full`` without a dtype keeps the one its value implies (``5`` int64, ``True`` bool).

    ``stepping`` (the optimizer's first step, ``_first_states``): no op computes on a tensor of ``BIG`` elements.
    An in-place op on one leaves it as it is; an op that makes a new tensor from one gets storage of the shape,
    stride and dtype the op would give (worked out on the meta device) and no values; a view is still made,
    so a state that aliases a parameter stays an alias. The states' bytes are exact, their values never read,
    and a rank that holds a whole 406M GPT steps AdamW without touching its 6.5 GB of parameters, gradients and
    states.

    Worked example: ``torch.zeros(1 << 20)`` under it is an uninitialised tensor of 4 MiB (no page touched),
    ``torch.zeros(8)`` is eight zeros; ``big.copy_(src)`` returns ``big`` as it was; stepping,
    ``big.mul_(0.9)`` returns ``big`` as it was and ``big.sqrt()`` a new uninitialised tensor of ``big``'s shape."""
    import math

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves, tree_map

    aten = torch.ops.aten  # a fill value is always positional here; kwargs hold dtype, device, layout, pin_memory
    fresh = {aten.zeros.default, aten.ones.default, aten.full.default}
    like = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}
    new = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
    inplace = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.copy_.default}

    def numel(size) -> int:
        return math.prod(int(d) for d in size)

    def big(t) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() >= BIG

    def no_compute(func, args, kwargs):
        """``func`` on big tensors while stepping, without computing: NotImplemented where it must run."""
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return NotImplemented  # a view: made for real, an alias of what it views
        if schema.name.endswith("_") and not schema.name.endswith("__"):  # in-place: left as it is
            return args[0] if schema.returns else None
        if schema.is_mutable:
            return NotImplemented  # out= and the like: rare, run as they are
        metas = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        device = next(t.device for t in tree_leaves((args, kwargs)) if big(t))
        try:
            shaped = func(*metas[0], **metas[1])
        except (NotImplementedError, RuntimeError):  # no meta kernel, or a shape that depends on values
            return NotImplemented
        if not all(isinstance(o, torch.Tensor) for o in tree_leaves(shaped)):
            return NotImplemented  # a number or a bool: a value the step may read, so computed for real
        return tree_map(lambda o: torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=device), shaped)

    class Unwritten(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if stepping and any(big(t) for t in tree_leaves((args, kwargs))):
                out = no_compute(func, args, kwargs)
                if out is not NotImplemented:
                    return out
            if func in inplace and args[0].numel() >= BIG:
                return args[0]
            if func in fresh and numel(args[0]) >= BIG:
                if func is aten.full.default and kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.tensor(args[1]).dtype  # as full infers it: int64, bool, the default
                return aten.empty.memory_format(args[0], **kwargs)
            if func in like and args[0].numel() >= BIG:
                return aten.empty_like.default(args[0], **kwargs)
            if func in new and numel(args[1]) >= BIG:
                return aten.new_empty.default(args[0], args[1], **kwargs)
            return func(*args, **kwargs)

    return Unwritten()


def _one(job: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg, t0, name = job["config"], time.perf_counter(), job["optimizer"]
    model = meta_twin(job["model"])  # a fresh copy per rank: boost cuts the model it is given
    model.init_parameter = _no_values  # type: ignore[assignment]  # the recipe replaced: a dry run makes no values
    torch.set_num_threads(1)
    kind = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}.get(str(name).lower())
    factory = name if callable(name) else kind if kind is not None else (
        lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.0 if "no" in name else 0.9))
    dist.init_process_group("fake", store=FakeStore(), rank=job["rank"], world_size=cfg.world_size)
    try:
        with _unwritten():  # storage without values: the bytes are what is reported (``_unwritten``)
            engine = boost(model, factory, cfg, policy=job["policy"])
        try:
            with _unwritten(stepping=True):
                _first_states(engine.optimizer)
            return _measure(engine, job, t0)
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()


def _first_states(optimizer) -> None:
    """One step on zero gradients, the gradients left as they were: the states a first real step makes
    (torch makes them lazily), on every tensor the optimizer steps."""
    import torch
    given = [p for g in optimizer.param_groups for p in g["params"] if p.grad is None]
    for p in given:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in given:
        p.grad = None


def _measure(engine, job: dict, t0: float) -> dict:
    import torch

    cfg, mesh, gpt, twin, policy = engine.config, engine.mesh, job["gpt"], job["model"], engine.policy
    pp_rank, batch, seq = mesh.rank(Axis.PP), job["batch"], job["seq"]
    if gpt is not None:  # the activations memory_estimate() gives after a step of this batch
        states = {0: "sgd-nomomentum", 1: "sgd-momentum", 2: "adamw"}[optimizer_states(engine.optimizer)]
        acts = config_estimate(gpt, cfg, batch, states, seq=seq, pp_rank=pp_rank)["activations"]
    else:
        gpt, acts, image = gpt_like(twin, policy) if policy is not None else None, 0, getattr(twin, "cfg", None)
        if policy is not None and policy.sequence:
            acts = model_activations(twin, policy, cfg, (batch, seq), torch.int64, pp_rank=pp_rank)
        elif policy is not None and image is not None and hasattr(image, "image_size"):
            shape = (batch, image.channels, image.image_size, image.image_size)
            acts = model_activations(twin, policy, cfg, shape, torch.float32, pp_rank=pp_rank)
    mem, est = engine.memory(), engine.memory_estimate()  # (model states by the engine's estimator)
    mem = {**{k: mem[k] for k in MEMORY_KEYS[:3]}, "activations": acts,
           "device": {**mem["device"], "activations": acts}, "host": {**mem["host"], "activations": 0}}
    total = sum(p.numel() for p in twin.parameters())
    size = f"{total / 1e6:.1f}M" if total >= 10 ** 6 else f"{total:,}"
    return {"rank": job["rank"], "config": cfg, "model": f"{type(twin).__name__} {size} params", "batch": batch,
            "seq": seq, "coords": mesh.layout.all_coords(job["rank"]),
            "groups": {a: mesh.ranks(a) for a in mesh.layout.axes},
            "n_params": sum(p.numel() for p in engine.module.parameters()), "memory": mem,
            "estimate": {**{k: est[k] for k in MEMORY_KEYS[:3]}, "activations": acts},
            "seconds": time.perf_counter() - t0, "gpt": gpt}

"""``dry_run(model, config, rank=r)``: what rank r of a run far larger than this machine would hold.

Rank r is built in a fresh process, as rank r of ``config.world_size`` in torch's ``fake`` process group
(no peers, no communication; torchtitan's dry runs do the same): ``boost`` makes that rank's shards of
the model on the meta device, values left unset, and the optimizer steps once on zero gradients so that
its states exist as after a first step. No training step runs: under the fake group a pipeline receiver
would read the activation's shape from a header that never came (``pipeline.p2p``). Reported: what
``engine.memory()`` says on that rank after one real step for params, grads and optimizer, exactly
(tests/ranks/test_dry_run.py compares real runs to the byte); the activations the engine's estimate gives
after a step of ``batch`` (``colab_kit.memory.estimator``); coordinates and groups; the planner's cost model
(``planner.cost``) under each ``hardware``: node presets (``HARDWARE``: approximate datasheet figures,
assumptions with their sources; NVLink inside a node, InfiniBand across) and this machine's measured
constants (``planner.constants``). The caller joins no process group; bad input is a ``ConfigError``
before any process starts.

Worked example: GPT 406.4M (vocab 50304, seq 1024, d_model 1024, 16 heads, 24 layers, untied head),
AdamW, ``ParallelConfig(dp=8, tp=8, pp=8, microbatches=8)`` = 512 ranks, batch 64. Rank 37 is
((pp 0 * 8 + dp 4) * 1 + sp 0) * 8 + tp 5; about 2 s here, 0.9 s of it the rank itself::

    >>> print(dry_run(GPT(cfg, device="meta"), config, rank=37, batch=64, hardware="8xH100-SXM"))  # doctest: +SKIP
    dry run: rank 37 of 512, dp=8 x pp=8 x tp=8 (1d) = 512 ranks, 1f1b x 8 microbatches; GPT 406.4M params, ...
    coordinates: pp 0, dp 4, sp 0, tp 5
    groups: pp 8 [37, 101, .., 485], dp 8 [5, 13, .., 61], sp 1 [37], tp 8 [32..39]
    holds 12,227,200 parameters
    bytes             exact (engine.memory())        estimate
      params           48,908,800    46.6 MiB      48,908,800
      grads            48,908,800    46.6 MiB      48,908,800
      optimizer        97,817,752    93.3 MiB      97,817,600
      activations     554,369,024   528.7 MiB     554,369,024  (activations: the estimate only)
      on the device 750,004,376 B, on the host 0 B
    step time on 8xH100-SXM: 42.4 ms (estimated; compute 21.2 ms, bubble 15.5 ms, comm:tp 2.98 ms, ...); fits ...
        assumed: approximate datasheet figures: NVIDIA H100 SXM5 80GB (FP32 67 TFLOP/s, ...

The token table cut over tp (6,438,912), the positions whole (1,048,576), blocks 0-2 cut over tp (3 x
1,579,904): ``estimate.rank_params``; the optimizer's 152 B more are AdamW's step counters (4 B x 38 tensors).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ..config import ConfigError, ParallelConfig
from ..errors import RankError, RankTimeout
from ..engine.checks import check_policy
from ..engine.core import boost, unsupported
from ..memory.estimator import config_estimate, gpt_like, model_activations
from ..memory.formulas import OPTIMIZER_STATES, optimizer_states
from ..models import GPT, GPTConfig
from ..sequence.plan import LAYOUT, check_length
from ..sharded_init import meta_twin
from .constants import cache_path, constants
from .cost import step_seconds
from .hardware import HARDWARE, Hardware
from .scale import price
from .shape import ModelShape

__all__ = ["HARDWARE", "LOCAL", "DryRunReport", "DryRunTimeout", "Hardware", "dry_run", "dry_run_many",
           "hardware_constants"]


LOCAL = "this machine"
"""The hardware name of the constants measured here (``planner.constants.constants(ranks=4)``, cached)."""
_DEFAULT = ("8xA100-80GB", "8xH100-SXM", LOCAL)
_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "sendrecv")
_KEYS = ("params", "grads", "optimizer", "activations")


def hardware_constants(name: str, precision: str = "fp32", link: str = "intra") -> dict:
    """A preset as the cost model's constants, every collective over ``link`` ("intra": NVLink, "inter":
    InfiniBand), one GPU per rank; ``ck.plan(..., constants=hardware_constants("8xH100-SXM"))`` takes them."""
    hw = HARDWARE[name]
    alpha, beta = hw.intra if link == "intra" else hw.inter
    return {"ranks": 0, "cores": 1 << 30, "matmul": {"flops_per_s": hw.flops[precision]},
            "dispatch": {"op_seconds": hw.op_seconds}, "memory": {"bytes_per_s": hw.memory_bytes_per_s},
            "comm": {"2": {op: {"alpha": alpha, "beta": beta} for op in _OPS}}, "source": hw.source}


@dataclass
class DryRunReport:
    """What one rank of ``config`` holds and costs (see the module docstring)."""
    rank: int
    config: ParallelConfig
    model: str
    batch: int
    seq: int | None
    coords: dict    # axis -> this rank's index (pp, dp, sp, tp and the tensor mode's sub-axes)
    groups: dict    # axis -> this rank's group (global ranks)
    n_params: int   # parameters this rank holds (before ZeRO shards them)
    memory: dict    # engine.memory()'s keys: params, grads, optimizer exact; activations estimated
    estimate: dict  # colab_kit.memory.estimator's figures for this rank (engine.memory_estimate())
    step_seconds: dict = field(default_factory=dict)  # hardware name -> estimated seconds per step
    breakdown: dict = field(default_factory=dict)     # hardware name -> seconds by part
    hardware: dict = field(default_factory=dict)      # hardware name -> what was assumed, and whence
    fits: dict = field(default_factory=dict)          # preset name -> device bytes fit one GPU
    seconds: float = 0.0                              # wall time of this rank's dry run

    def __str__(self) -> str:
        c, m = self.config, self.memory
        lines = [f"dry run: rank {self.rank} of {c.world_size}, {c.describe()}; {self.model}, batch {self.batch}"
                 + (f" x {self.seq}" if self.seq else ""),
                 "coordinates: " + ", ".join(f"{a} {i}" for a, i in self.coords.items()),
                 "groups: " + ", ".join(f"{a} {len(g)} {_ranks(g)}" for a, g in self.groups.items()),
                 f"holds {self.n_params:,} parameters", f"{'bytes':<13}{'exact (engine.memory())':>28}{'estimate':>16}"]
        lines += [f"  {k:<11}{m[k]:>16,} {_mib(m[k]):>11}{self.estimate[k]:>16,}"
                  + ("  (activations: the estimate only)" if k == "activations" else "") for k in _KEYS]
        lines.append(f"  on the device {sum(m['device'].values()):,} B, on the host {sum(m['host'].values()):,} B")
        for name, s in self.step_seconds.items():
            parts = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(self.breakdown[name].items(),
                                                                             key=lambda kv: -kv[1]))
            fit = "" if name not in self.fits else "; fits in one GPU" if self.fits[name] else "; DOES NOT FIT one GPU"
            lines += [f"step time on {name}: {s * 1e3:.4g} ms (estimated; {parts}){fit}",
                      f"    assumed: {self.hardware[name]}"]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from html import escape
        return "<pre>" + escape(str(self)) + "</pre>"


def _ranks(g: list) -> str:
    if len(g) <= 4:
        return str(g)
    return f"[{g[0]}..{g[-1]}]" if g == list(range(g[0], g[-1] + 1)) else f"[{g[0]}, {g[1]}, .., {g[-1]}]"


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:.2f} GiB"


class DryRunTimeout(RankTimeout):
    """The dry-run process did not finish in time (it waits on no peer: the model is too big or slow)."""

    def summary(self) -> str:
        return (f"the dry run of rank {', '.join(map(str, self.stuck))} did not finish within {self.timeout:g} s"
                + (f" ({self.where})" if self.where else "") + (f"\n{self.advice}" if self.advice else ""))


def dry_run(model, config: ParallelConfig, *, rank=0, batch: int | None = None, seq: int | None = None,
            optimizer="adamw", policy=None, hardware=_DEFAULT, timeout: float = 120.0):
    """Rank ``rank``'s share of ``config`` training ``model`` (a module, on the meta device or not, or a
    GPTConfig), built in a fresh process under the fake process group; a list of ranks (or "all") gives a
    list of reports, all made in one process. ``batch``: global rows per step (default: the fewest that
    split); ``seq``: tokens per row (default: the model's); ``optimizer``: "adamw", "adam", "sgd-momentum",
    "sgd-nomomentum" or a picklable factory ``params -> optimizer``; ``policy``: as ``boost``'s;
    ``hardware``: names of ``HARDWARE`` and ``LOCAL``, or constants dicts; ``timeout``: seconds in all."""
    out = dry_run_many([{"model": model, "config": config, "rank": rank, "batch": batch, "seq": seq,
                         "optimizer": optimizer, "policy": policy}], hardware=hardware, timeout=timeout)
    return out[0] if isinstance(rank, int) else out


def dry_run_many(calls: list, *, hardware=_DEFAULT, timeout: float = 120.0) -> list:
    """``dry_run`` of several configs in one process: ``calls`` are dicts of its keyword arguments
    (``model``, ``config``, ``rank``, ...); every report, in order."""
    hardware = [hardware] if isinstance(hardware, (str, dict)) else list(hardware or ())
    for h in hardware:
        if isinstance(h, str) and h not in HARDWARE and h != LOCAL:
            raise ConfigError(f"unknown hardware {h!r}: choose from {', '.join([*HARDWARE, LOCAL])}, or pass "
                              f"a constants dict (ck.planner.EXAMPLE_CONSTANTS shows its keys)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}: try 120")
    jobs = [job for call in calls for job in _prepare(**call)]
    return [_timed(r, hardware) for r in _spawn(jobs, timeout)]


def _prepare(model, config, rank=0, batch=None, seq=None, optimizer="adamw", policy=None) -> list:
    """The jobs of one call, every check made here, before any process starts (ConfigError)."""
    import torch.nn as nn

    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be a ck.ParallelConfig, got {type(config).__name__}")
    world = config.world_size
    ranks = list(range(world)) if rank == "all" else [rank] if isinstance(rank, int) else list(rank)
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            raise ConfigError(f"rank {r!r} is outside {config.describe()}: give a rank 0..{world - 1} "
                              f"(or a list of them, or 'all')")
    if unsupported(config) is not None:
        raise ConfigError(unsupported(config))
    if config.offload == "auto":
        raise ConfigError("offload='auto' places chunks after a measured step, which a dry run does not take: "
                          "dry-run offload='cpu' (everything ZeRO shards on the host) or offload='none'")
    model = GPT(model, device="meta") if isinstance(model, GPTConfig) else model
    if not isinstance(model, nn.Module):
        raise ConfigError(f"dry_run takes a model (an nn.Module, e.g. GPT(cfg, device='meta')) or a GPTConfig, "
                          f"got {type(model).__name__}")
    if not callable(optimizer) and str(optimizer).lower() not in OPTIMIZER_STATES:
        raise ConfigError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)}, or pass "
                          f"a factory params -> optimizer (picklable)")
    twin = meta_twin(model)  # shapes only: checked and sent to the dry-run process; the caller's model untouched
    policy = check_policy(twin, config, policy)
    cfg_attr = getattr(model, "cfg", None)
    gpt = cfg_attr if isinstance(cfg_attr, GPTConfig) else None
    shards = {"1d": 1, "2d": config.tp_q, "2.5d": config.tp_depth * config.tp_q, "3d": config.tp_q ** 2}[config.tp_mode]
    need = config.dp * config.microbatches * shards  # rows: dp x microbatches x the tensor plan's row shards
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or batch % need):
        raise ConfigError(f"batch={batch!r} does not split over dp={config.dp} x microbatches={config.microbatches}"
                          + (f" x the tensor plan's {shards} row shards" if shards > 1 else "")
                          + f": use a multiple of {need}, e.g. {need * max(1, round((batch or need) / need))}")
    if gpt is not None or (policy is not None and policy.sequence):
        longest = gpt.seq_len if gpt is not None else gpt_like(twin, policy).seq_len
        seq = longest if seq is None else seq
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq <= longest:
            raise ConfigError(f"seq={seq!r} tokens per row: the model takes 1..{longest}")
        if config.sp > 1 and config.sp_mode != "split_gather":
            check_length(seq, config.sp, LAYOUT[config.sp_mode])
    else:
        seq = None
    return [{"model": twin, "config": config, "rank": r, "batch": batch or need, "seq": seq, "optimizer": optimizer,
             "policy": policy, "gpt": gpt} for r in ranks]


def _spawn(jobs: list, timeout: float) -> list:
    """Run ``jobs`` in one fresh process (``_child``): their results, or RankError / DryRunTimeout."""
    import cloudpickle  # a factory or policy defined in a notebook travels by value

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above colab_kit/
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="colab_kit-dry-run-") as tmp:
        src, dst = os.path.join(tmp, "jobs.pkl"), os.path.join(tmp, "results.pkl")
        with open(src, "wb") as fh:
            pickle.dump(sys.path, fh)
            cloudpickle.dump(jobs, fh)
        child = "import sys; from colab_kit.planner.at_scale import _child; _child(*sys.argv[1:])"
        cmd = [sys.executable, "-c", child, src, dst]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            job = jobs[_running(exc.stderr)]
            raise DryRunTimeout([job["rank"]], timeout, f"ck.dry_run of {job['config'].describe()}",
                                f"pass a larger timeout= (it was {timeout:g} s for {len(jobs)} rank(s))") from None
        if not os.path.exists(dst):  # the process died before it could report
            job = jobs[_running(done.stderr)]
            raise RankError({job["rank"]: done.stderr[-4000:]}, where=f"ck.dry_run of {job['config'].describe()} "
                                                                      f"(exit code {done.returncode})")
        with open(dst, "rb") as fh:
            out = pickle.load(fh)
    if out and "error" in out[-1]:
        job = jobs[len(out) - 1]
        raise RankError({job["rank"]: out[-1]["error"]}, where=f"ck.dry_run of {job['config'].describe()}")
    return out


def _running(stderr) -> int:
    """Which job the dry-run process was at, from the lines ``_child`` writes to stderr."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    at = [int(line.split()[-1]) for line in text.splitlines() if line.startswith("colab_kit dry run: job ")]
    return at[-1] if at else 0


def _child(src: str, dst: str) -> None:
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


def _unwritten():
    """A dispatch mode under which tensors of ``BIG`` elements or more get their storage and no values: a
    fill (``zeros``, ``full``, ``zero_``, ``fill_``) allocates or leaves the memory as it is, a ``copy_`` into
    one is skipped. The bytes a rank holds are what a dry run reports, counted by storage; its values
    are never read. Untouched pages are not resident, so a rank's flat buffers are not paid for in this
    process's memory or time: the 512-rank ZeRO-2 config of notebook 08 (a 406M GPT, ``ck.plan(...,
    exact=2)``) took 11 s and 3.5 GB resident before, most of it zeroing and copying the full flat buffers
    of params and grads (1.6 GB each). Other ops still write (the optimizer's first step into its states,
    ``cat``, ``clone``, ``out=``), and so do fills of smaller tensors (offsets, indices, counters). A
    ``torch.full`` without a dtype keeps the one its value implies (``5`` int64, ``True`` bool).

    Worked example: ``torch.zeros(1 << 20)`` under it is an uninitialised tensor of 4 MiB (no page touched),
    ``torch.zeros(8)`` is eight zeros; ``big.copy_(src)`` returns ``big`` as it was."""
    import math

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten  # a fill value is always positional here; kwargs hold dtype, device, layout, pin_memory
    fresh = {aten.zeros.default, aten.ones.default, aten.full.default}
    like = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}
    new = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
    inplace = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.copy_.default}

    def numel(size) -> int:
        return math.prod(int(d) for d in size)

    class Unwritten(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
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
            with _unwritten():
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
    pp_rank, batch, seq = mesh.rank("pp"), job["batch"], job["seq"]
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
    mem = {**{k: mem[k] for k in _KEYS[:3]}, "activations": acts, "device": {**mem["device"], "activations": acts},
           "host": {**mem["host"], "activations": 0}}
    total = sum(p.numel() for p in twin.parameters())
    size = f"{total / 1e6:.1f}M" if total >= 10 ** 6 else f"{total:,}"
    return {"rank": job["rank"], "config": cfg, "model": f"{type(twin).__name__} {size} params", "batch": batch,
            "seq": seq, "coords": mesh.layout.all_coords(job["rank"]),
            "groups": {a: mesh.ranks(a) for a in mesh.layout.axes},
            "n_params": sum(p.numel() for p in engine.module.parameters()), "memory": mem,
            "estimate": {**{k: est[k] for k in _KEYS[:3]}, "activations": acts},
            "seconds": time.perf_counter() - t0, "gpt": gpt}


def _timed(raw: dict, hardware: list) -> DryRunReport:
    """The report, with the step time under each hardware: on a preset ``ck.estimate``'s at-scale model
    (``planner.scale.price``: NVLink inside a node, the node's NICs across nodes); on this machine, or with
    constants given, the local cost model (``planner.cost``)."""
    import dataclasses

    gpt = raw.pop("gpt")
    rep = DryRunReport(**raw)
    cfg, mem = rep.config, rep.memory
    if gpt is None:  # a model without a policy: no cost model
        return rep
    gpt = dataclasses.replace(gpt, seq_len=rep.seq) if rep.seq and rep.seq != gpt.seq_len else gpt
    for i, h in enumerate(hardware):
        if isinstance(h, dict):
            name, parts = h.get("name", f"constants {i}"), step_seconds(gpt, cfg, rep.batch, h, mem)[1]
            rep.hardware[name] = h.get("source", "the constants given")
        elif h == LOCAL:
            consts = {**constants(ranks=4), "cores": cfg.world_size}
            name, parts = LOCAL, step_seconds(gpt, cfg, rep.batch, consts, mem)[1]
            rep.hardware[name] = (f"each rank as fast as one of 4 CPU ranks measured on this machine (gloo; "
                                  f"colab_kit.planner.constants, cached in {cache_path()})")
        else:  # a preset: ck.estimate's at-scale model (planner.scale), the groups placed on nodes by rank
            name, hw = h, HARDWARE[h]
            parts = dict(price(ModelShape.of(gpt), cfg, rep.batch, hw, seq=rep.seq or gpt.seq_len).breakdown)
            rep.hardware[name] = hw.source
            rep.fits[name] = sum(mem["device"].values()) <= hw.usable_bytes
        rep.step_seconds[name], rep.breakdown[name] = sum(parts.values()), parts
    return rep

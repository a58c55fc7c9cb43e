"""``dry_run(model, config, rank=r)``: what rank r of a run far larger than this machine would hold.

Rank r is built in a fresh process (forked from a warm server: ``launch.warm``), as rank r of
``config.world_size`` in torch's ``fake`` process group (no peers, no communication; torchtitan's dry runs do
the same): ``boost`` makes that rank's shards of
the model on the meta device, values left unset, and the optimizer steps once on zero gradients so that
its states exist as after a first step. No training step runs: under the fake group a pipeline receiver
would read the activation's shape from a header that never came (``pipeline.p2p``). Reported: what
``engine.memory()`` says on that rank after one real step for params, grads and optimizer, exactly
(tests/ranks/test_dry_run.py compares real runs to the byte); the activations the engine's estimate gives
after a step of ``batch`` (``colab_kit.memory.estimator``); coordinates and groups; the planner's cost model
(``planner.local.step``) under each ``hardware``: node presets (``HARDWARE``: approximate datasheet figures,
assumptions with their sources; NVLink inside a node, InfiniBand across) and this machine's measured
constants (``planner.local.constants``). The caller joins no process group; bad input is a ``ConfigError``
before any process starts.

Worked example: GPT 406.4M (vocab 50304, seq 1024, d_model 1024, 16 heads, 24 layers, untied head),
AdamW, ``ParallelConfig(dp=8, tp=8, pp=8, microbatches=8)`` = 512 ranks, batch 64. Rank 37 is
((pp 0 * 8 + dp 4) * 1 + sp 0) * 8 + tp 5; 0.44 s here without pricing (``bench/results/dry_run.json``)::

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
import sys
import tempfile

from ...config import ConfigError, ParallelConfig
from ...errors import RankError, RankTimeout
from ...engine.checks import check_policy
from ...engine.core import unsupported
from ...launch.warm import fork_call
from ...memory.estimator import gpt_like
from ...memory.formulas import OPTIMIZER_STATES
from ...models import GPT, GPTConfig
from ...sequence.plan import LAYOUT, check_length
from ...sharded_init import meta_twin
from ..cluster.hardware import HARDWARE
from ..local.constants import LOCAL
from .report import DryRunReport, with_step_times

__all__ = ["DryRunReport", "DryRunTimeout", "dry_run", "dry_run_many"]

_DEFAULT = ("8xA100-80GB", "8xH100-SXM", LOCAL)


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
    return [with_step_times(r, hardware) for r in _spawn(jobs, timeout)]


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
    """Run ``jobs`` in one child forked from a warm server (``launch.warm.fork_call``: the kernel's fork server,
    or ``ck.launch``'s forkserver), which runs ``child.run_jobs``: their results, or RankError / DryRunTimeout.
    A new interpreter took 3.5 s here for a small GPT's dry run, forked it takes 0.07 s."""
    import cloudpickle  # a factory or policy defined in a notebook travels by value

    with tempfile.TemporaryDirectory(prefix="colab_kit-dry-run-") as tmp:
        src, dst, log = (os.path.join(tmp, name) for name in ("jobs.pkl", "results.pkl", "log"))
        with open(src, "wb") as fh:
            pickle.dump(sys.path, fh)
            cloudpickle.dump(jobs, fh)
        child = fork_call("colab_kit.planner.dry_runs.child:run_jobs", [src, dst], log)
        try:
            code = child.wait(timeout)
        except BaseException:  # Ctrl-C in the notebook: the child goes with the call, as a subprocess did
            child.kill()
            raise
        if code is None:
            child.kill()
            job = jobs[_running(_read(log))]
            raise DryRunTimeout([job["rank"]], timeout, f"ck.dry_run of {job['config'].describe()}",
                                f"pass a larger timeout= (it was {timeout:g} s for {len(jobs)} rank(s))") from None
        if not os.path.exists(dst):  # the process died before it could report
            text = _read(log)
            job = jobs[_running(text)]
            raise RankError({job["rank"]: text[-4000:]}, where=f"ck.dry_run of {job['config'].describe()} "
                                                               f"(exit code {code})")
        with open(dst, "rb") as fh:
            out = pickle.load(fh)
    if out and "error" in out[-1]:
        job = jobs[len(out) - 1]
        raise RankError({job["rank"]: out[-1]["error"]}, where=f"ck.dry_run of {job['config'].describe()}")
    return out


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _running(stderr) -> int:
    """Which job the dry-run process was at, from the lines ``child.run_jobs`` writes to stderr."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    at = [int(line.split()[-1]) for line in text.splitlines() if line.startswith("colab_kit dry run: job ")]
    return at[-1] if at else 0

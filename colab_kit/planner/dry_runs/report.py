"""What ``ck.dry_run`` reports of one rank (``DryRunReport``), and its step time under each hardware
(``with_step_times``: a preset by the at-scale cost model, this machine or constants given by the local one)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...config import ParallelConfig
from ..cluster.hardware import HARDWARE
from ..cluster.price import price
from ..local.constants import LOCAL, cache_path, constants
from ..local.step import step_seconds
from ..shape import ModelShape

__all__ = ["DryRunReport", "MEMORY_KEYS", "with_step_times"]

MEMORY_KEYS = ("params", "grads", "optimizer", "activations")
"""The keys of a report's ``memory`` and ``estimate`` (``engine.memory()``'s, activations the estimate's)."""


@dataclass
class DryRunReport:
    """What one rank of ``config`` holds and costs (see ``dry_runs.run``'s module docstring)."""
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
                  + ("  (activations: the estimate only)" if k == "activations" else "") for k in MEMORY_KEYS]
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


def with_step_times(raw: dict, hardware: list) -> DryRunReport:
    """The report, with the step time under each hardware: on a preset ``ck.estimate``'s at-scale model
    (``planner.cluster.price.price``: NVLink inside a node, the node's NICs across nodes); on this machine, or with
    constants given, the local cost model (``planner.local.step``)."""
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
                                  f"colab_kit.planner.local.constants, cached in {cache_path()})")
        else:  # a preset: ck.estimate's at-scale model (planner.cluster.price), the groups placed on nodes by rank
            name, hw = h, HARDWARE[h]
            parts = dict(price(ModelShape.of(gpt), cfg, rep.batch, hw, seq=rep.seq or gpt.seq_len).breakdown)
            rep.hardware[name] = hw.source
            rep.fits[name] = sum(mem["device"].values()) <= hw.usable_bytes
        rep.step_seconds[name], rep.breakdown[name] = sum(parts.values()), parts
    return rep

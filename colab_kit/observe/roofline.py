"""``ck.roofline(engine)``: where a config's training step sits against this machine's two roofs, the
measured matmul peak and the measured cost of its collectives, and so whether it is compute- or
communication-bound, and why.

One rank's step does ``F`` FLOPs (the dense model's ``model_flops`` shared over the ranks) and sends ``W``
wire bytes in ``k`` collectives (the engine's comm records of the last step). The machine runs matmuls at
``P`` FLOP/s (``throughput.peak_matmul``, measured) and a collective ``op`` on a group of ``n`` ranks costs
``alpha + wire / beta`` (``planner.local.constants``, measured in a running loop). So::

    compute_s    = F / P                          the step's matmuls at the peak
    comm_s       = sum(alpha + wire / beta)       its collectives at the measured costs
    latency_s    = sum(alpha)                     the part of comm_s that no bandwidth removes
    intensity    = F / W                          FLOP per byte sent (x axis)
    bandwidth    = W / comm_s                     this step's effective bytes per second, latency included
    ridge        = P / bandwidth                  the intensity at which both roofs meet
    roof         = min(P, intensity * bandwidth)  the most FLOP/s this step can reach (y axis: achieved)
    bound        = "communication" if intensity < ridge (comm_s > compute_s) else "compute"

``achieved`` is ``F`` over the measured median step time, ``mfu`` is ``achieved / P``; what the roof does
not explain (``achieved / roof``) is the rest of a step: the ops that are not matmuls, Python, idle.

Worked example, measured here (2 cores, constants measured with 2 ranks): the GPT of
``tests/cluster/test_profile.py`` (d=32, 2 layers) on a batch [8, 16], AdamW, 4 steps. Per rank ``F`` = 11.1 MFLOP,
0.05 ms at the 212 GFLOP/s peak. At tp=2 it sends 165,380 B in 13 all-reduces: intensity 67 FLOP/B, 18.8 ms
by the constants, 99% of it alpha: communication-bound by latency, roof 0.59 GFLOP/s, achieved 0.40
(the step measured 27.7 ms). At dp=2, 120,324 B in 3 all-reduces (two buckets and the loss): 4.4 ms, roof
2.5 GFLOP/s, achieved 1.9. On such a small model every config is latency-bound; ``why`` names the op.

The roofs are this machine's measurements; the point is the engine's last step. Nothing is assumed.
"""
from __future__ import annotations

from dataclasses import dataclass

from .measured import alpha_beta, cache_path, cached
from .throughput import engine_throughput

__all__ = ["Roofline", "roofline", "roofline_figure"]


@dataclass
class Roofline:
    """One rank's step against the roofs (see the module docstring); plain data, seconds, bytes, FLOP."""

    rank: int
    config: str
    flops: float            # F: this rank's share of the step's matmul FLOPs
    wire_bytes: int         # W: bytes this rank sent in the last step
    collectives: int
    compute_s: float
    comm_s: float
    latency_s: float
    measured_s: float       # the median step time the engine recorded
    peak: float             # P, FLOP/s
    by_op: dict             # op@axis -> [count, wire bytes, seconds by the constants]

    @property
    def intensity(self) -> float:
        return self.flops / self.wire_bytes if self.wire_bytes else float("inf")

    @property
    def bandwidth(self) -> float:
        return self.wire_bytes / self.comm_s if self.comm_s > 0 else float("inf")

    @property
    def ridge(self) -> float:
        return self.peak / self.bandwidth if self.comm_s > 0 else 0.0

    @property
    def roof(self) -> float:
        return min(self.peak, self.intensity * self.bandwidth)

    @property
    def achieved(self) -> float:
        return self.flops / self.measured_s

    @property
    def mfu(self) -> float:
        return self.achieved / self.peak

    @property
    def bound(self) -> str:
        return "communication" if self.comm_s > self.compute_s else "compute"

    def why(self) -> str:
        def ms(s):
            return f"{s * 1e3:.2f} ms"

        if not self.collectives:
            return f"no collectives: compute-bound, {ms(self.compute_s)} of matmuls at the peak"
        top = max(self.by_op.items(), key=lambda kv: kv[1][2])
        lat = self.latency_s / self.comm_s
        cause = "latency (alpha)" if lat > 0.5 else "bytes (beta)"
        return (f"{self.bound}-bound: {self.collectives} collectives, {self.wire_bytes:,} B, take {ms(self.comm_s)} "
                f"by the measured constants ({lat:.0%} of it latency: mostly {cause}) against {ms(self.compute_s)} "
                f"of matmuls at {self.peak / 1e9:.0f} GFLOP/s; the most is {top[0]} ({top[1][0]}x, {ms(top[1][2])}); "
                f"intensity {self.intensity:,.0f} FLOP/B, ridge {self.ridge:,.0f}")

    def summary(self) -> str:
        return (f"rank {self.rank} ({self.config}): {self.achieved / 1e9:.2f} GFLOP/s achieved, MFU {self.mfu:.1%}, "
                f"roof {self.roof / 1e9:.2f} GFLOP/s; {self.why()}")


def roofline(engine, constants: dict | None = None, peak: float | None = None, last: int | None = None) -> Roofline:
    """This rank's ``Roofline`` for the engine's last step (``ck.roofline(engine)``). ``constants``: the planner's
    (``colab_kit.planner.constants(ranks=N)``, measured in the notebook; default: the cached ones
    for this world size, an error naming that call if there are none); ``peak``: FLOP/s (default: the
    measured matmul peak of this rank's device and threads); ``last``: the recorded steps whose median time is
    the measured one (``engine.throughput``'s; default all but the first)."""
    if not engine.records:
        raise ValueError("ck.roofline(engine) needs a step to place: run engine.train_step(batch) first")
    consts = constants if constants is not None else _cached(engine.config.world_size)
    tp = engine_throughput(engine, last=last)
    peak = float(peak) if peak is not None else tp["peak_flops"]
    mesh = engine.mesh
    by_op: dict[str, list] = {}
    comm_s = latency = 0.0
    records = engine.mesh.log.last_step()
    for r in records:
        n = 2 if r.op in ("send", "recv", "sendrecv") else mesh.size(r.axis)
        if n <= 1:
            continue
        alpha, beta = alpha_beta(consts, r.op, n)
        s = alpha + r.wire / beta
        comm_s, latency = comm_s + s, latency + alpha
        row = by_op.setdefault(f"{r.op}@{r.axis}", [0, 0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + r.wire, row[2] + s
    flops = tp["flops_per_step"] / tp["world_size"]
    return Roofline(mesh.global_rank, engine.config.describe(), flops, sum(r.wire for r in records),
                    sum(v[0] for v in by_op.values()), flops / peak, comm_s, latency, tp["step_seconds"], peak, by_op)


def _cached(world: int) -> dict:
    got = cached(world)
    if got is None:
        raise ValueError(f"no measured collective constants for {world} ranks in {cache_path()}: measure them once "
                         f"in the notebook with colab_kit.planner.constants(ranks={world}) (about 20 s on 2 cores, "
                         f"then cached) and pass them as ck.roofline(engine, constants=...), or call it again after")
    return got


def roofline_figure(points, title: str = "Roofline: each config's step against this machine (measured)"):
    """Log-log: FLOP per wire byte against FLOP/s; the matmul peak and each point's communication roof
    (``intensity * bandwidth``, its measured constants), the achieved FLOP/s as a marker per config."""
    import plotly.graph_objects as go

    points = list(points)
    fig = go.Figure()
    finite = [p.intensity for p in points if p.wire_bytes] or [1.0]
    lo, hi = min(finite) / 10, max(finite) * 10
    peak = max(p.peak for p in points)
    fig.add_scatter(x=[lo, hi], y=[peak, peak], mode="lines", name=f"matmul peak {peak / 1e9:.0f} GFLOP/s",
                    line={"color": "black"})
    for p in points:
        label = f"{p.config} (rank {p.rank})"
        if p.wire_bytes:
            xs = [lo, p.ridge, hi]
            fig.add_scatter(x=xs, y=[min(peak, x * p.bandwidth) for x in xs], mode="lines", line={"dash": "dot"},
                            name=f"{label}: comm roof", legendgroup=label)
        fig.add_scatter(x=[p.intensity if p.wire_bytes else hi], y=[p.achieved], mode="markers", name=label,
                        legendgroup=label, marker={"size": 11}, hovertext=p.summary(), hoverinfo="text")
    fig.update_layout(template="plotly_white", title=title, height=460,
                      xaxis={"type": "log", "title": "FLOP per byte sent (this rank, one step)"},
                      yaxis={"type": "log", "title": "FLOP/s (this rank)"})
    return fig

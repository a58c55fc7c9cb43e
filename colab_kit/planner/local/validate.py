"""The planner against runs: boost the top candidates, train a few steps, compare.

``validate(model, ranks, batch, top)`` plans, takes the best candidate of each of the first
``top`` layouts (``distinct_layouts``), then in ONE ``ck.launch`` of ``ranks`` processes boosts
them all and trains them in turn, ``steps`` rounds on ``SyntheticTokens`` (``run_candidates``: each config
2 warm-up and 2 timed steps a round; the fullest rank's memory, the slowest rank's time), and returns one
row per candidate: estimated and measured model-state bytes (params + grads + optimizer), activations, and
median step seconds (the first round left out), plus the Spearman rank correlation of the times.
"""
from __future__ import annotations

import statistics
import time

from .. import plan
from ...config import ParallelConfig
from ...datasets import SyntheticTokens
from ...engine.core import boost
from ...launch import launch
from ...models import GPT, GPTConfig

__all__ = ["validate", "spearman", "accuracy", "run_candidates", "distinct_layouts", "format_rows"]


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equal-length sequences (average ranks for ties)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(list(a)), ranks(list(b))
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 0.0


def accuracy(rows: list[dict]) -> dict:
    """How right the estimates of ``rows`` (``validate``'s, in the planner's order) are, in four figures:

    - ``scale``: the median over candidates of measured / estimated seconds: the absolute level (1.0: right;
      a machine whose speed moved between measuring its constants and the runs moves all of them alike);
    - ``shape``: the largest deviation of one candidate's measured / estimated from that median (0.1: every
      candidate within 10% once the level is set): a cost the model misses for one layout (a mode's ops,
      an axis's messages) shows here, a change of the whole machine's speed does not;
    - ``error``: the largest ``|estimated - measured| / measured``; ``regret``: the planner's first choice
      measured against the fastest measured (0.05: 5% slower).

    Worked example: estimates 10, 20, 40 ms measured 12, 22, 40: ratios 1.2, 1.1, 1.0, scale 1.1, shape
    0.09 (1.2 / 1.1 - 1), error 0.17 (2 of 12), regret 0 (the first is the fastest)::

        >>> a = accuracy([{"est_seconds": e, "seconds": m} for e, m in ((10, 12), (20, 22), (40, 40))])
        >>> {k: round(v, 2) for k, v in a.items()}
        {'scale': 1.1, 'shape': 0.09, 'error': 0.17, 'regret': 0.0}
    """
    ratios = [r["seconds"] / r["est_seconds"] for r in rows]
    scale = statistics.median(ratios)
    return {"scale": scale, "shape": max(abs(x / scale - 1) for x in ratios),
            "error": max(abs(r["est_seconds"] - r["seconds"]) / r["seconds"] for r in rows),
            "regret": rows[0]["seconds"] / min(r["seconds"] for r in rows) - 1}


def run_candidates(model_kwargs: dict, configs: list[dict], kwargs: list[dict], batch: int, steps: int,
                   warm: int = 2, timed: int = 2) -> list[dict]:
    """On every rank: boost every config (all engines alive at once), then ``steps`` rounds in which each
    config in turn runs ``warm`` steps and then ``timed`` timed ones, so that a change in the machine's load
    falls on all of them alike while each timed step follows steps of its own config, as in training; this
    rank's memory and median step seconds per config (the first round is not timed).

    Why the untimed steps: a step right after another config's ran 20-30% slower than in training (measured
    by hand once, dp=4 on 4 ranks / 2 cores, the 4-block test GPT: 16 ms alone, 21 ms alternating step by step with 6
    other configs, 17 ms as the third and fourth of four consecutive steps): the caches hold the other engine's
    parameters, states and buffers, and the cheapest configs lose most."""
    import torch


    g = GPTConfig(**model_kwargs)
    data = SyntheticTokens(g.vocab_size, g.seq_len, seed=0)
    engines = [boost(GPT(g), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ParallelConfig(**c), **kw)
               for c, kw in zip(configs, kwargs)]
    times: list[list[float]] = [[] for _ in engines]
    losses: list[list[float]] = [[] for _ in engines]
    per_round = warm + timed
    for s in range(steps + 1):
        for i, engine in enumerate(engines):
            for k in range(per_round):
                t = time.perf_counter()
                losses[i].append(engine.train_step(data.batch(s * per_round + k, batch)))
                if s and k >= warm:
                    times[i].append(time.perf_counter() - t)
    out = []
    for i, engine in enumerate(engines):
        mem = engine.memory()
        out.append({"memory": {k: mem[k] for k in ("params", "grads", "optimizer", "activations")},
                    "seconds": statistics.median(times[i]), "losses": losses[i]})
        engine.close()
    return out


def distinct_layouts(cands, top: int) -> list:
    """The best candidate of each layout (degrees and modes; schedule, ZeRO, offload and recompute
    free), in the planner's order, the first ``top`` of them: what a user chooses between."""
    seen, out = set(), []
    for c in cands:
        k = c.config
        key = (k.dp, k.tp, k.tp_mode, k.tp_depth, k.pp, k.sp, k.sp_mode)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out[:top]


def validate(model, ranks: int = 4, batch: int = 16, top: int = 6, steps: int = 4, constants=None) -> dict:
    """Plan ``model`` (a GPTConfig) on ``ranks`` ranks, run the top ``top`` candidates; rows + Spearman."""
    import dataclasses


    cands = distinct_layouts(plan(model, ranks, batch, constants=constants), top)
    res = launch(run_candidates, ranks, dataclasses.asdict(model), [c.config.to_dict() for c in cands],
                 [c.boost_kwargs for c in cands], batch, steps)
    rows = []
    for i, c in enumerate(cands):
        per_rank = [r[i] for r in res]
        # the rank the estimate describes: the fullest (most model-state + activation bytes)
        worst = max(per_rank, key=lambda r: sum(r["memory"].values()))
        est_states = c.memory["params"] + c.memory["grads"] + c.memory["optimizer"]
        got = worst["memory"]
        rows.append({"config": c.describe(), "est_states": est_states,
                     "states": got["params"] + got["grads"] + got["optimizer"],
                     "est_activations": c.memory["activations"], "activations": got["activations"],
                     "est_seconds": c.step_seconds, "est_parts": dict(c.breakdown),
                     "seconds": max(r["seconds"] for r in per_rank),
                     "losses": per_rank[0]["losses"]})
    rho = spearman([r["est_seconds"] for r in rows], [r["seconds"] for r in rows])
    return {"rows": rows, "spearman": rho}


def format_rows(result: dict) -> str:
    head = (f"{'config':44} {'states est':>11} {'measured':>11} {'acts est':>11} {'measured':>11} "
            f"{'ms est':>7} {'measured':>8}")
    lines = [head]
    for r in result["rows"]:
        lines.append(f"{r['config'][:44]:44} {r['est_states']:>11,} {r['states']:>11,} {r['est_activations']:>11,} "
                     f"{r['activations']:>11,} {1e3 * r['est_seconds']:7.1f} {1e3 * r['seconds']:8.1f}")
    lines.append(f"Spearman rank correlation of step times: {result['spearman']:.2f}")
    return "\n".join(lines)

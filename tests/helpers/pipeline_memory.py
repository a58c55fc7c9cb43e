"""A pipeline rank's measured memory against the number of microbatches and each schedule's bound.

``measure_peaks(cases)`` runs on every rank of a pp=2 launch (``tests/ranks/test_pipeline_engine.py`` runs it
in the spawn of its pp=2 test); ``check_peaks(results, cases)`` asserts on what came back. Each case is
``(schedule, chunks, microbatches, n_layers)`` with 2 rows per microbatch, so a microbatch's activations
stay the same size as the step gets more of them. For each case a rank measures:

- ``held``, ``chunk``: from a step stepped one timestep at a time (``engine.step.advance``), the most
  (stage, microbatch) pairs held between F and B (or W) at once, and the most bytes one pair held (the
  activation meter's count, as ``state()["held_bytes"]`` moves with each F and I);
- ``peak``: ``engine.memory()["step_peak"]`` after ``ck.memory_timeline``'s step: every live storage after
  every op, whatever holds it (a send's tensor held by its Work counts here, and nowhere else);
- ``saved``: the most bytes autograd held saved at once in that step (the timeline's "activations").

On pp rank 0 of 1F1B with 2 layers (one block per stage) a pair is about 67 KB, each message 4 KiB
(docs/pipeline.md has every case)::

    m=4 : held 2, peak 366,852 B       the executor that kept every send to the step's end:
    m=64: held 2, peak 382,212 B       m=4 375,044 B, m=64 636,164 B (60 x 4 KiB more, and the ids)

(the 15,360 B between m=4 and m=64 are the global batch's token ids, 128 rows instead of 8, which the
embedding's saved input is a view of).
"""
from __future__ import annotations

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from colab_kit.pipeline.actions import parse

from .references import OPTIMIZERS

__all__ = ["ROWS", "PEAK_CASES", "bound", "measure_peaks", "check_peaks"]

ROWS = 2  # rows per microbatch: the batch grows with the microbatches
PEAK_CASES = [("1f1b", 1, 4, 2), ("1f1b", 1, 16, 2), ("1f1b", 1, 64, 2),
              ("zb-v", 2, 4, 4), ("zb-v", 2, 16, 4), ("interleaved", 2, 8, 4), ("interleaved", 2, 16, 4)]


def bound(schedule: str, chunks: int, m: int, pp: int, r: int) -> int:
    """The documented most (stage, microbatch) pairs pipeline rank ``r`` holds (``pipeline/schedules.py``):
    1F1B its pp-1-r warm-up forwards and one more; interleaved its 2(pp-1-r) + (v-1)pp warm-up forwards and
    one more (all m*v when m == pp); ZB-V 2pp chunk-microbatches, the list scheduler's limit."""
    if schedule == "1f1b":
        return min(pp - r, m)
    if schedule == "interleaved":
        total = m * chunks
        return total if m == pp else min(2 * (pp - 1 - r) + (chunks - 1) * pp + 1, total)
    assert schedule == "zb-v", schedule
    return 2 * pp


def _stepped(engine, batch) -> tuple[int, int]:
    """Step ``batch`` one timestep at a time: (most pairs held at once, most bytes one pair held)."""
    step, pipe = engine.step, engine.pipeline
    step.begin(batch)
    sizes: dict = {}  # (stage, microbatch) -> the bytes it holds now
    held, chunk, done, before = 0, 0, 0, 0
    while pipe.timestep < pipe.n_timesteps:
        st = step.advance(1)
        new = st["executed"][done:]
        assert len(new) <= 1, new  # the lockstep grid: one action per rank per timestep
        for a in map(parse, new):
            if a.kind in ("F", "I"):  # F: the pair's bytes; I: they become what its W keeps
                key = a.stage, a.microbatch
                sizes[key] = sizes.get(key, 0) + st["held_bytes"] - before
                chunk = max(chunk, sizes[key])
        done, before, held = len(st["executed"]), st["held_bytes"], max(held, len(st["held"]))
    step.finish()
    return held, chunk


def measure_peaks(cases) -> dict:
    """On each rank of a pp=2 launch: per case, ``held``, ``chunk``, ``peak`` and ``saved`` (the docstring)."""
    out = {}
    for schedule, chunks, m, n_layers in cases:
        cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=n_layers)
        engine = ck.boost(GPT(cfg), OPTIMIZERS["sgd"],
                          ck.ParallelConfig(pp=2, microbatches=m, schedule=schedule, chunks=chunks))
        data = SyntheticTokens(64, 16, seed=1)
        engine.train_step(data.batch(0, ROWS * m))  # the meter's shapes and the buckets, before measuring
        held, chunk = _stepped(engine, data.batch(1, ROWS * m))
        timeline = ck.memory_timeline(engine, data.batch(2, ROWS * m))
        out[schedule, m] = dict(held=held, chunk=chunk, peak=engine.memory()["step_peak"],
                                saved=max(timeline.series["activations"]))
        engine.close()
    return out


def check_peaks(results: list[dict], cases) -> dict:
    """Every case against its bound, and each schedule's peak flat in the microbatches: the peak at the most
    microbatches within one pair's bytes of the peak at the fewest. Returns ``{(rank, schedule): {m: peak}}``
    (what docs/pipeline.md quotes)."""
    peaks: dict = {}
    for rank, res in enumerate(results):
        for schedule, chunks, m, _ in cases:
            got = res[schedule, m]
            most = bound(schedule, chunks, m, 2, rank)
            assert got["held"] <= most, (rank, schedule, m, got)
            assert got["saved"] <= most * got["chunk"], (rank, schedule, m, got, most)
            peaks.setdefault((rank, schedule), {})[m] = got["peak"], got["chunk"]
    for (rank, schedule), by_m in peaks.items():
        low, chunk = by_m[min(by_m)]  # one pair's bytes at the fewest microbatches (the meter's count of a
        for m, (peak, _) in by_m.items():  # pair grows with the batch its token ids are a view of)
            assert peak - low <= chunk, (rank, schedule, m, peak, low, chunk, by_m)
    return {k: {m: p for m, (p, _) in v.items()} for k, v in peaks.items()}

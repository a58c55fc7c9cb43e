"""Safe after a hang: blocked ranks stop on another rank's report, long before their own timeout, a broken
pipeline refuses further steps, and engines built in a loop leak no thread, store connection
or process group (one shared mesh per config, released by ``engine.close()``)."""
from __future__ import annotations

import gc
import threading
import time

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from colab_kit.pipeline.hang import PipelineHang

GPT4 = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
BATCH = 8


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def _blocked():
    """pp=2 x tp=2, timeout 30 s: rank 0 fails at the start of 0F1; its tp peer blocks in the tp
    all-reduce of 0F1 and the pp=1 ranks block in the receive 1RF1. Each says when it stopped."""
    import torch.distributed as dist

    rank, data = dist.get_rank(), SyntheticTokens(64, 16, seed=1)
    cfg = ck.ParallelConfig(pp=2, tp=2, microbatches=2, schedule="gpipe")
    engine = ck.boost(GPT(GPT4), _sgd, cfg)
    pipe = engine.pipeline
    pipe.timeout = 30.0
    engine.train_step(data.batch(0, BATCH))  # a good step first
    failed_at = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        forward = pipe._do_F

        def fail(a, s, m):
            if m == 1:
                failed_at[0] = time.time()
                raise ZeroDivisionError("injected in 0F1")
            return forward(a, s, m)
        pipe._do_F = fail
    out = {"rank": rank}
    try:
        engine.train_step(data.batch(1, BATCH))
        out["error"] = None
    except (PipelineHang, ZeroDivisionError) as exc:
        out.update(error=type(exc).__name__, message=str(exc), stopped=time.time())
    try:
        engine.train_step(data.batch(2, BATCH))
        out["again"] = None
    except PipelineHang as exc:
        out["again"] = str(exc)
    out["failed_at"] = failed_at.item() if rank == 0 else None
    return out


def test_blocked_ranks_stop_on_a_report_long_before_their_timeout():
    results = ck.launch(_blocked, 4, timeout=90)
    t_fail = results[0]["failed_at"]
    assert results[0]["error"] == "ZeroDivisionError"
    for res in results[1:]:
        assert res["error"] == "PipelineHang", res
        waited = res["stopped"] - t_fail
        # told by rank 0's report (within a second on an idle machine), not by their own 30 s timeout
        assert waited < 10, f"rank {res['rank']} stopped {waited:.2f} s after the failure (timeout was 30 s)"
    # rank 1 (pp 0, tp 1) was inside the tp all-reduce of 0F1, ranks 2, 3 in the receive 1RF1
    assert "stopped in 0F1" in results[1]["message"] and "rank 0 reported" in results[1]["message"], results[1]
    for r in (2, 3):
        assert "1RF1" in results[r]["message"], results[r]["message"]
    for res in results:  # a broken pipeline runs no further step, on every rank, and says why
        assert res["again"] is not None and "runs no more pipeline steps" in res["again"], res
        assert "restart the ranks" in res["again"]


def _loop():
    """Build, train and close pipeline engines in a loop; count threads, connections and groups."""
    import psutil
    import torch.distributed as dist

    from colab_kit.mesh import ProcessMesh

    data, cfg = SyntheticTokens(64, 16, seed=1), ck.ParallelConfig(pp=2, microbatches=2)
    proc = psutil.Process()

    def census():
        monitors = sum(t.name.startswith("colab_kit pipeline hang monitor") for t in threading.enumerate())
        return dict(monitors=monitors, connections=len(proc.net_connections(kind="tcp")),
                    groups=len(dist.distributed_c10d._world.pg_map))

    base = census()
    counts, same_mesh = [], None
    for i in range(4):
        a = ck.boost(GPT(GPT4), _sgd, cfg)
        b = ck.boost(GPT(GPT4), _sgd, cfg)  # two engines at once share one mesh
        same_mesh = a.mesh is b.mesh and a.mesh.users == 2
        a.train_step(data.batch(i, BATCH))
        b.train_step(data.batch(i, BATCH))
        during = census()
        a.close()
        b.close()
        counts.append((during, census()))
    closed_error = None
    try:
        a.train_step(data.batch(0, BATCH))
    except RuntimeError as exc:
        closed_error = str(exc)
    held = ProcessMesh.shared(cfg)  # held as the notebook cluster holds its mesh: no engine to give back
    generations: list[int] = []

    def note(phase, info):
        if phase == "stop":
            generations.append(info["generation"])
    gc.callbacks.append(note)
    try:
        ProcessMesh.prune()  # nothing an engine holds: no full collection paid for
    finally:
        gc.callbacks.remove(note)
    held.release()
    dropped = ck.boost(GPT(GPT4), _sgd, cfg)  # never closed: collected, its monitor ends
    dropped.train_step(data.batch(0, BATCH))
    monitor = dropped.pipeline.monitor
    del dropped
    gc.collect()
    time.sleep(0.3)
    kept = len(ProcessMesh._shared)  # the collector alone never destroys a mesh (ranks collect at other times)
    pruned = ProcessMesh.prune()     # the next boost does this, at the same point on every rank
    return dict(base=base, counts=counts, same_mesh=same_mesh, closed_error=closed_error, kept=kept, pruned=pruned,
                dropped_alive=monitor.alive, shared_left=len(ProcessMesh._shared), after=census(),
                full_collections=generations.count(2), frozen=gc.get_freeze_count())


def test_engines_in_a_loop_leak_no_thread_connection_or_group():
    for res in ck.launch(_loop, 2, timeout=120):
        base = res["base"]
        assert res["same_mesh"], "two engines of one config must share one mesh"
        for during, after in res["counts"]:
            assert during["monitors"] == 2 and during["groups"] > base["groups"], (during, base)
            assert after == base, f"after close: {after}, before the loop: {base}"
        assert "closed" in res["closed_error"]
        assert not res["dropped_alive"], "the hang monitor of a dropped engine kept running"
        assert res["kept"] == 1 and res["pruned"] == 1, res  # kept through gc, given back by prune()
        assert res["full_collections"] == 0, res  # a mesh held by no engine: prune() collected nothing
        assert res["frozen"] > 0, res  # the rank froze what it inherited from ck.launch's fork server
        assert res["shared_left"] == 0 and res["after"] == base, res  # the dropped engine's mesh went with it

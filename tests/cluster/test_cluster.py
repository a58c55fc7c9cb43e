"""Cluster: real ipyparallel engines with torch.distributed (tier 3)."""
from __future__ import annotations

import _thread
import os
import re
import shutil
import socket
import threading
import time

import psutil
import pytest

import colab_kit as ck
from colab_kit.launch import cores_for_rank
from colab_kit.notebook.cluster import Cluster, ClusterError


def _rank_times_ten():
    import torch.distributed as dist

    return dist.get_rank() * 10


def _env():
    import torch

    from colab_kit.launch import threads_per_rank

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: os.environ[k] for k in keys}, "pid": os.getpid(), "threads": torch.get_num_threads(),
            "expected_threads": threads_per_rank(4),
            "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def _all_reduce(x):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)]) * x
    dist.all_reduce(t)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dist.get_rank())
    return t.item(), gathered


def _fail_on_rank_1_while_others_wait():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(torch.ones(1))  # ranks 0, 2, 3 wait here for rank 1 forever
    return "unreachable"


def _fail_everywhere():
    import torch.distributed as dist

    raise KeyError(f"missing on {dist.get_rank()}")


def test_ranks_table_matches_the_engines(cluster):
    table = cluster.ranks()
    assert [row["rank"] for row in table] == [0, 1, 2, 3]
    assert {row["device"] for row in table} == {"cpu"} and {row["backend"] for row in table} == {"nccl_rules"}
    envs = cluster.run(_env)
    assert [row["pid"] for row in table] == [e["pid"] for e in envs]
    assert len({e["pid"] for e in envs}) == 4
    for rank, e in enumerate(envs):
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"]) == (str(rank), "4", str(rank))
        assert e["threads"] == e["expected_threads"]
    if envs[0]["cores"] is not None:  # each engine bound to its cores (launch.bind_rank), a thread per core
        allowed = sorted(os.sched_getaffinity(0))  # the engines' launcher's, as this process's
        assert [e["cores"] for e in envs] == [cores_for_rank(r, 4, allowed) for r in range(4)]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert "rank" in str(table) and str(table[0]["pid"]) in table._repr_html_()


def test_run_gives_results_by_rank(cluster):
    assert cluster.run(_rank_times_ten) == [0, 10, 20, 30]
    assert cluster.run(_rank_times_ten, ranks=[3, 1]) == {1: 10, 3: 30}
    assert cluster.run(lambda a, b: a + b, 2, 3) == [5, 5, 5, 5]
    with pytest.raises(ClusterError, match=r"not ranks of this cluster: choose among 0..3"):
        cluster.run(_rank_times_ten, ranks=[7])


def test_all_reduce_across_engines(cluster):
    results = cluster.run(_all_reduce, 2.0)
    assert results == [(20.0, [0, 1, 2, 3])] * 4  # (1+2+3+4)*2 on every rank


def test_execute_captures_output_per_rank_with_rank_config_mesh_predefined(cluster):
    out = cluster.execute("import sys\nprint('hi', rank)\nprint('warn', file=sys.stderr)\nrank * 2")
    assert sorted(out) == [0, 1, 2, 3]
    for r, o in out.items():
        assert (o.stdout, o.stderr, o.result, o.status) == (f"hi {r}\n", "warn\n", str(2 * r), "ok")
    assert cluster.execute("print(config, mesh)", ranks=[2])[2].stdout == "None None\n"


def _read_x():
    from colab_kit.notebook.cluster.remote import namespace
    return namespace().get("x")


def test_a_call_submitted_behind_a_cell_runs_after_it_on_its_rank(cluster):
    """``execute(..., sent=)`` then ``submit``: the call reaches the engine behind the cell and runs after it
    (an engine runs its requests in order: what the magic's line of what a cell trained relies on)."""
    asked = []
    cluster.execute("import time\ntime.sleep(0.2)\nx = rank + 100",
                    sent=lambda: asked.append(cluster.submit(_read_x, rank=2)))
    assert cluster.collect(asked[0], timeout=30) == 102  # it saw the cell's x: it ran after the cell
    assert cluster.collect(cluster.submit(_read_x, rank=1), timeout=30) == 101
    with pytest.raises(ck.RankError) as info:
        cluster.collect(cluster.submit(_fail_everywhere, rank=3), timeout=30)
    assert list(info.value.failures) == [3] and "missing on 3" in info.value.failures[3]
    with pytest.raises(TimeoutError, match="rank 0 did not answer within 0.1 s"):
        cluster.collect(cluster.submit(time.sleep, 1.0, rank=0), timeout=0.1)
    assert cluster.run(_rank_times_ten) == [0, 10, 20, 30]  # the slow call finished first, in order
    with pytest.raises(ClusterError, match="not ranks of this cluster"):
        cluster.submit(_read_x, rank=4)


def test_set_config_builds_the_mesh_on_every_rank(cluster):
    cfg = ck.ParallelConfig(dp=2, tp=2)
    cluster.set_config(cfg)
    assert cluster.config == cfg
    out = cluster.execute("print(config.describe(), mesh.ranks('tp'), mesh.ranks('dp'))")
    assert [o.stdout for o in out.values()] == [
        "dp=2 x tp=2 (1d) = 4 ranks [0, 1] [0, 2]\n", "dp=2 x tp=2 (1d) = 4 ranks [0, 1] [1, 3]\n",
        "dp=2 x tp=2 (1d) = 4 ranks [2, 3] [0, 2]\n", "dp=2 x tp=2 (1d) = 4 ranks [2, 3] [1, 3]\n"]
    with pytest.raises(ck.ConfigError, match="needs dp\\*pp\\*sp\\*tp = 8\\*1\\*1\\*1 = 8 ranks, but there are 4"):
        cluster.set_config(ck.ParallelConfig(dp=8))
    assert cluster.config == cfg  # unchanged: refused before any engine was touched
    assert cluster.execute("print(config.dp)", ranks=[0])[0].stdout == "2\n"


def test_every_rank_failing_needs_no_restart(cluster):
    with pytest.raises(ck.RankError) as info:
        cluster.run(_fail_everywhere)
    assert sorted(info.value.failures) == [0, 1, 2, 3] and info.value.stuck == []
    assert "KeyError" in info.value.failures[2] and "missing on 2" in info.value.failures[2]
    assert not cluster.needs_restart
    assert cluster.run(_rank_times_ten) == [0, 10, 20, 30]


def test_timeout_without_failure_raises_rank_timeout_and_blocks_until_done(cluster):
    """Raised at the timeout, while the ranks still sleep (the next call is refused: still running), not when
    they are done; then the call runs to its end, not cut short, and the cluster takes calls again."""
    t0 = time.monotonic()
    with pytest.raises(ck.RankTimeout) as info:
        cluster.run(time.sleep, 5.0, timeout=0.3)
    assert info.value.stuck == [0, 1, 2, 3] and "restart" in str(info.value)
    with pytest.raises(ClusterError, match="still running a call that timed out"):
        cluster.run(_rank_times_ten)
    while "still running a call that timed out" in cluster.status():  # the ranks finish their sleep
        assert time.monotonic() - t0 < 60, cluster.status()
        time.sleep(0.05)
    assert time.monotonic() - t0 >= 5.0  # it ran to its end, not cut short
    assert cluster.run(_rank_times_ten) == [0, 10, 20, 30]


def test_failing_rank_is_reported_while_others_wait_then_restart_works(cluster):
    old_pids = [row["pid"] for row in cluster.ranks()]
    cluster.set_config(ck.ParallelConfig(dp=4))
    t0 = time.monotonic()
    with pytest.raises(ck.RankError) as info:
        cluster.run(_fail_on_rank_1_while_others_wait, timeout=60)
    elapsed = time.monotonic() - t0
    err = info.value
    # the grace after the failure, not the 60 s timeout (the grace and a second or two on an idle machine)
    assert elapsed < cluster.grace + 30, f"the caller hung for {elapsed:.1f} s"
    assert err.rank == 1 and list(err.failures) == [1] and err.stuck == [0, 2, 3]
    assert "rank 1 refuses" in err.failures[1] and "_fail_on_rank_1_while_others_wait" in err.failures[1]
    assert "%colossal restart" in err.advice and "cluster.restart()" in str(err)
    assert cluster.needs_restart and "NEEDS RESTART" in cluster.status()
    with pytest.raises(ClusterError, match="needs a restart"):
        cluster.run(_rank_times_ten)

    cluster.restart()
    assert not cluster.needs_restart
    assert set(old_pids).isdisjoint(row["pid"] for row in cluster.ranks())
    for pid in old_pids:  # the stuck engines were really killed
        with pytest.raises(ProcessLookupError):
            _wait_gone(pid)
    assert cluster.run(_all_reduce, 1.0) == [(10.0, [0, 1, 2, 3])] * 4
    assert cluster.config == ck.ParallelConfig(dp=4)  # re-applied on the fresh engines
    assert cluster.execute("print(mesh.ranks('dp'))", ranks=[3])[3].stdout == "[0, 1, 2, 3]\n"


def _exit_on_rank_2():
    import os

    import torch.distributed as dist

    if dist.get_rank() == 2:
        os._exit(3)  # as if killed or out of memory: no traceback, no result
    return dist.get_rank()


def _slow_loop():
    import time

    for _ in range(1200):  # 120 s: far longer than an interrupt takes to stop it
        time.sleep(0.1)
    return "finished"


def test_interrupt_reaches_the_ranks(cluster):
    t0 = time.monotonic()
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        cluster.run(_slow_loop)
    assert time.monotonic() - t0 < 60  # stopped by the interrupt (at 0.5 s), not run to its end (120 s)
    assert not cluster.needs_restart and cluster.run(_rank_times_ten) == [0, 10, 20, 30]  # not still looping


def test_a_rank_whose_engine_dies_is_reported_and_needs_a_restart(cluster):
    with pytest.raises(ck.RankError) as info:
        cluster.run(_exit_on_rank_2, timeout=60)
    assert info.value.rank == 2 and "engine process died" in info.value.failures[2]
    assert "exited with code 3 (os._exit" in info.value.failures[2]  # how it ended: the fork server reaped it
    assert f"(on host {socket.gethostname()!r}, pid " in info.value.failures[2]  # where to look
    assert cluster.needs_restart and "%colossal restart" in str(info.value)
    with pytest.raises(ClusterError, match="needs a restart"):
        cluster.run(_rank_times_ten)  # the fixture restarts it for the next test


def _wait_gone(pid: int) -> None:
    """Raise ProcessLookupError once ``pid`` is gone (a zombie still counts as gone)."""
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    raise ProcessLookupError(pid)


def test_bad_launcher_name_is_a_clear_error():
    with pytest.raises(ClusterError) as info:
        Cluster(n=2, engines="slurmm")
    msg = str(info.value)
    assert "unknown engine launcher engines='slurmm'" in msg and "local" in msg and "slurm" in msg


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ClusterError, match="n must be a positive whole number"):
        Cluster(n=0)
    with pytest.raises(ClusterError, match="backend must be 'nccl', 'nccl_rules', 'gloo'"):
        Cluster(n=2, backend="mpi")


def test_ssh_hosts_are_checked_before_anything_starts(monkeypatch, tmp_path):
    import colab_kit.notebook.cluster.startup as startup
    monkeypatch.setattr(startup, "_default_profile_configures_launchers", lambda: False)
    with pytest.raises(ClusterError, match=r"engines='ssh' needs the hosts .*--hosts 10.0.0.1:2,10.0.0.2:2"):
        Cluster(engines="ssh", ip="10.0.0.1")
    with pytest.raises(ClusterError, match=r"hosts= says where .* not engines='mpi'"):
        Cluster(engines="mpi", ip="10.0.0.1", hosts={"10.0.0.2": 2})
    with pytest.raises(ClusterError, match=r"n=3 engines, but hosts= names 4"):
        Cluster(n=3, engines="ssh", ip="10.0.0.1", hosts={"a": 2, "b": 2})
    for bad in ({}, {"a": 0}, {"a": True}, ["a", "b"], {"": 2}):
        with pytest.raises(ClusterError, match="hosts must map each host to its number of engines"):
            Cluster(engines="ssh", ip="10.0.0.1", hosts=bad)
    cluster = Cluster(engines="ssh", ip="10.0.0.1", hosts={"a": 2, "b": 1})
    assert cluster.n == 3 and cluster.hosts == {"a": 2, "b": 1} and not cluster.running
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    (tmp_path / "profile_ssh").mkdir()
    Cluster(engines="ssh", ip="10.0.0.1", profile="ssh")  # the profile's ipcluster_config.py may name them
    with pytest.raises(ClusterError, match=r"no IPython profile 'shh' in .*; did you mean 'ssh'\?"):
        Cluster(engines="ssh", ip="10.0.0.1", profile="shh")  # ipyparallel would make an empty one
    with pytest.raises(ClusterError, match=r"profile_dir='/nowhere' is not a directory"):
        Cluster(engines="ssh", ip="10.0.0.1", profile_dir="/nowhere")
    with pytest.raises(ClusterError, match=r"unknown keyword collective_timout=.*did you mean 'collective_timeout'"):
        Cluster(n=2, collective_timout=30)
    with pytest.raises(ClusterError, match=r"ip='10.0.0.1' is not an address, interface or name of this host"):
        Cluster(n=2, ip="10.0.0.1")
    import socket
    assert Cluster(n=2, ip=socket.gethostname()).ip == socket.gethostname()  # this host's name resolves here
    assert Cluster(n=2, ip="127.0.0.1", log_level=20).ip == "127.0.0.1"  # ipyparallel's own keywords pass
    assert startup.host_order(["b", "a", "b", "a", "c"]) == [0, 2, 1, 3, 4]


def test_engines_that_do_not_register_in_time_give_a_clear_error():
    engines_before = {p.pid for p in psutil.Process().children(recursive=True) if _is_engine(p)}
    t0 = time.monotonic()
    cluster = Cluster(n=2, timeout=0.5)
    with pytest.raises(ClusterError, match=r"only [01] of 2 engines registered within 0.5 s") as info:
        cluster.start()
    assert "timeout=" in str(info.value)
    assert not cluster.running and time.monotonic() - t0 < 30
    late = [p for p in psutil.Process().children(recursive=True) if _is_engine(p) and p.pid not in engines_before]
    assert late == [], f"engines that registered too late were left running: {late}"
    with pytest.raises(ClusterError, match="no cluster is running"):
        cluster.run(_rank_times_ten)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpi4py mpich)")
def test_mpi_engines_start_train_and_restart():
    """The multi-host launch path on one machine: engines started by mpiexec, whose ids are reused."""
    with Cluster(n=2, engines="mpi", ip="127.0.0.1", timeout=180) as cluster:
        assert [row["rank"] for row in cluster.ranks()] == [0, 1]
        assert cluster.run(_all_reduce, 1.0) == [(3.0, [0, 1])] * 2
        pids = {row["pid"] for row in cluster.ranks()}
        cluster.restart()
        assert pids.isdisjoint(row["pid"] for row in cluster.ranks())
        assert cluster.run(_all_reduce, 2.0) == [(6.0, [0, 1])] * 2
    assert not cluster.running


def _print_then_sleep():
    import time

    import torch.distributed as dist

    print(f"rank {dist.get_rank()} working", flush=True)
    time.sleep(2.5)
    return dist.get_rank()


def test_progress_takes_true_and_false_like_tqdms_disable(cluster, capsys):
    assert cluster.run(_rank_times_ten, progress=False) == [0, 10, 20, 30]
    assert cluster.run(_rank_times_ten, progress=True) == [0, 10, 20, 30]
    assert cluster.execute("rank", progress=False)[3].result == "3"
    for bad in (3, "loud"):
        with pytest.raises(TypeError, match=r"progress=.*: give True or False \(on or off\)"):
            cluster.run(_rank_times_ten, progress=bad)
        with pytest.raises(TypeError, match=r"progress=.*: give True or False"):
            Cluster(n=2).start(progress=bad)  # refused before anything starts
    assert cluster.run(_rank_times_ten) == [0, 10, 20, 30]  # nothing was left running


def test_long_run_calls_report_progress_with_what_the_ranks_printed(cluster, monkeypatch):
    seen = []
    assert cluster.run(_print_then_sleep, progress=lambda t, out: seen.append((t, dict(out)))) == [0, 1, 2, 3]
    assert seen and seen[-1][0] >= 1.0
    assert any(out.get(3) == "rank 3 working\n" for _, out in seen)
    # in a notebook kernel the default is a live line (colab_kit.notebook.progress.Progress), closed at the end
    import colab_kit.notebook.cluster.core as core
    from colab_kit.notebook.progress import Progress

    lines = []

    class Recorder(Progress):
        def show(self, text):
            lines.append(text)

        def close(self):
            lines.append("closed")

    monkeypatch.setattr(core, "notebook_progress", lambda n: Recorder(n))
    cluster.run(_print_then_sleep)
    # a line while it runs with what rank 0 printed (the seconds it shows are the machine's: not asserted)
    assert any(re.match(r"running on 4 ranks for \d+ s; rank 0: rank 0 working", t) for t in lines), lines
    assert lines[-1] == "closed"


def _is_engine(p) -> bool:
    """An engine or a nanny started as its own interpreter, or one forked from the kernel's fork server (an engine
    forked by the server, its nanny forked by that engine: both carry the server's command line)."""
    from colab_kit.notebook.cluster import forked
    try:
        cmd = " ".join(p.cmdline())
        return ("ipyparallel.engine" in cmd or ("cluster.forked_server import serve" in cmd and p.pid != forked.server_pid())) \
            and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_results_are_matched_to_ranks_by_the_engine_that_ran_them():
    """The one assumption about ipyparallel's internals (a multi-engine result splits in target
    order) is checked on every call from public metadata; a reordering is an error, not a mix-up."""
    from colab_kit.notebook.cluster.results import check_ranks

    class Done:
        def __init__(self, engine_id, ok=True):
            self.metadata, self.ok = {"engine_id": engine_id}, ok

        def ready(self):
            return True

        def successful(self):
            return self.ok

        def get_dict(self, timeout):
            return {self.metadata["engine_id"]: None}

    check_ranks({0: Done(5), 1: Done(7)}, [5, 7])
    with pytest.raises(RuntimeError, match="rank 0 came from engine 7, not from its engine 5"):
        check_ranks({0: Done(7), 1: Done(5)}, [5, 7])
    check_ranks({0: Done(5, ok=False), 1: Done(7, ok=False)}, [5, 7])  # a failed result: its metadata says
    with pytest.raises(RuntimeError, match="rank 0 came from engine 7, not from its engine 5"):
        check_ranks({0: Done(7, ok=False), 1: Done(5)}, [5, 7])


_NOTEBOOK_CODE = """
import torch.nn as nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 3)

def build(make=Tiny):
    return sum(p.numel() for p in make().parameters())

def mark(value):
    from colab_kit.notebook.cluster.remote import namespace
    namespace()["marker"] = value * 10

def read():
    return marker
"""


def test_run_sends_a_notebook_class_and_reads_the_ranks_globals(cluster):
    """Functions and classes of a notebook (``__main__``) travel by value, an nn.Module subclass included
    (its ``super()`` cell once sent ipyparallel's canning into a recursion), and a notebook function reads
    the names a ``%%colossal`` cell made on the rank, as ipyparallel's own ``apply`` does."""
    ns = {"__name__": "__main__"}
    exec(_NOTEBOOK_CODE, ns)
    n = cluster.world_size
    assert cluster.run(ns["build"]) == [9] * n
    cluster.run(ns["mark"], 4)
    ns["marker"] = "the kernel's, not the rank's"
    assert cluster.run(ns["read"]) == [40] * n

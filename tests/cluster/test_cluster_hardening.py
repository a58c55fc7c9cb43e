"""The cluster layer, hardened (tier 3): loopback only, no orphans, deaths and interrupts.

Each test here fails without the behaviour it names: a store bound to every interface, a
cluster that outlives a SIGKILLed kernel, a peer blamed for a killed engine, a dead
controller waited on forever, a Ctrl-C that loses the ranks' output or leaves ranks out
of step unnoticed.
"""
from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import colab_kit as ck
from colab_kit.notebook.cluster import Cluster, ClusterError
from colab_kit.notebook.cluster.watchdog import wait_ended


def _listening(pids) -> list[tuple[int, str]]:
    """(pid, address) of every listening TCP socket of ``pids``."""
    out = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        out += [(pid, c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1"


def _rank_sockets(kernel_pid):
    """Inside a launched rank: its own listening sockets, and those of the launching process."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # gloo's pairs are up
    return _listening([os.getpid(), kernel_pid])


def test_launch_listens_on_loopback_only():
    found = ck.launch(_rank_sockets, 2, os.getpid())
    socks = [s for per_rank in found for s in per_rank]
    assert any(pid == os.getpid() for pid, _ in socks), "the rendezvous store should be listening"
    assert [s for s in socks if not _loopback(s[1])] == []


def test_cluster_listens_on_loopback_only(cluster):
    cluster.run(_rank_sockets, os.getpid())  # engines' gloo pairs are up
    procs = psutil.Process().children(recursive=True)
    socks = _listening([p.pid for p in procs])
    engine_pids = {row["pid"] for row in cluster.ranks()}
    assert {pid for pid, _ in socks} & engine_pids, "the engines' store and gloo should be listening"
    assert [s for s in socks if not _loopback(s[1])] == []


def test_multi_host_launchers_need_an_address_and_windows_is_refused(monkeypatch):
    with pytest.raises(ClusterError, match=r"ip='10\.0\.0\.5'.*ip='127\.0\.0\.1'"):
        Cluster(n=2, engines="mpi")
    assert Cluster(n=2, engines="mpi", ip="127.0.0.1").ip == "127.0.0.1"
    assert Cluster(n=2).ip == "127.0.0.1"
    monkeypatch.setattr(os, "name", "nt")
    with pytest.raises(ClusterError, match="POSIX"):
        Cluster(n=2)


_ORPHAN_SCRIPT = textwrap.dedent("""
    import json, sys, time, psutil
    from colab_kit.notebook.cluster import Cluster
    cluster = Cluster(n=2, timeout=180).start()
    kids = [p.pid for p in psutil.Process().children(recursive=True)]
    print(json.dumps(kids), flush=True)
    time.sleep(600)
""")


def test_a_zombie_counts_as_ended_and_a_running_process_does_not():
    """``wait_ended``, what ``cluster.stop()`` waits with: a process that exited but is not reaped yet (an orphan
    waits for PID 1 to reap it, up to 1.85 s on the CI machine) has ended; one still running has not. A parent that
    never reaps holds the zombie here, so the test does not depend on how fast this machine's init is;
    ``psutil.wait_procs`` returns the zombie as still running (every stop waited its whole grace second)."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, subprocess, sys, time
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        while open(f"/proc/{zombie.pid}/stat").read().split(") ")[1][0] != "Z":
            time.sleep(0.01)
        print(zombie.pid, sleeper.pid, flush=True)
        time.sleep(60)  # never reaps the zombie
        """)], stdout=subprocess.PIPE, text=True)
    try:
        zombie, sleeper = (psutil.Process(int(pid)) for pid in holder.stdout.readline().split())
        assert zombie.status() == psutil.STATUS_ZOMBIE
        ended, running = wait_ended([zombie, sleeper], 0.5)
        assert ended == [zombie] and running == [sleeper], (ended, running)
    finally:
        for p in [holder, *(c for c in psutil.Process(holder.pid).children())]:
            p.kill()
        holder.wait()


def test_no_orphans_when_the_kernel_is_sigkilled():
    child = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        pids = json.loads(line)
        alive = [p for p in map(_proc, pids) if p is not None]
        assert len(alive) >= 4, f"expected a controller, 2 engines and a watchdog, got {alive}"
        child.send_signal(signal.SIGKILL)
        child.wait()
        t0 = time.monotonic()
        gone, left = wait_ended(alive, 30)
        assert left == [], f"still running {time.monotonic() - t0:.0f} s after the kernel died: {left}"
    finally:
        child.kill()
        for pid in json.loads(line or "[]"):
            p = _proc(pid)
            if p is not None:
                p.kill()


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _barrier_forever():
    import time

    import torch.distributed as dist

    dist.barrier()
    time.sleep(1000)


def test_a_killed_engine_is_blamed_first_not_the_peer_that_lost_it(cluster):
    pid = cluster.ranks()[1]["pid"]
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(ck.RankError) as info:
        cluster.run(_barrier_forever, timeout=120)
    assert time.monotonic() - t0 < 60
    assert info.value.rank == 1, str(info.value)
    assert "engine process died" in info.value.failures[1] and "killed by SIGKILL (the out-of-memory" in info.value.failures[1]
    assert cluster.needs_restart


def _sleep_or_block():
    import time

    import torch
    import torch.distributed as dist

    print("started", dist.get_rank(), flush=True)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # blocked in C++: a SIGINT cannot stop it
    time.sleep(1000)


def test_ctrl_c_keeps_the_output_and_checks_the_ranks(cluster):
    threading.Timer(1.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt) as info:
        cluster.execute("import time\nprint('step', rank, flush=True)\ntime.sleep(1000)")
    outs = info.value.outputs
    assert sorted(outs) == [0, 1, 2, 3]
    assert all(o.stdout == f"step {r}\n" and o.status == "interrupted" for r, o in outs.items())
    assert not cluster.needs_restart  # every rank stopped, and the health check found them in step
    assert cluster.run(os.getpid) == [row["pid"] for row in cluster.ranks()]
    # now rank 0 is in a collective that the others never join: under nccl_rules its wait is interruptible, and
    # the health check (each group's collective count, no collective run) finds the ranks out of step
    threading.Timer(2.0, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        cluster.run(_sleep_or_block)
    status = cluster.status()
    assert cluster.needs_restart and "out of step" in status, status
    assert "rank 0 issued 1 collectives, rank 1 issued 0 collectives" in status, status


def test_a_dead_controller_is_detected_not_waited_on():
    with Cluster(n=2, timeout=180) as cluster:
        ours = {q.pid for q in cluster._controller_procs}
        controller = next(p for p in psutil.Process().children() if p.pid in ours and _is_controller(p))
        threading.Timer(1.0, controller.kill).start()
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match="controller process exited"):
            cluster.execute("import time; time.sleep(1000)")
        assert time.monotonic() - t0 < 30
        assert cluster.needs_restart


def _is_controller(p) -> bool:
    try:
        return "ipyparallel.controller" in " ".join(p.cmdline())
    except psutil.Error:  # another test's process that has just exited
        return False


def test_a_process_the_kernel_starts_meanwhile_is_not_taken_for_the_clusters():
    """``cluster_processes(before, roots)`` keeps what the launcher started (a root and its children) and
    leaves another new child of the kernel alone (it would otherwise be watched and killed with the cluster);
    without roots every new child is taken, which is the rule the roots fix."""
    from colab_kit.notebook.cluster.watchdog import cluster_processes, descendant_pids
    before = descendant_pids()
    root = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    stray = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.time() + 10
        while not psutil.Process(root.pid).children() and time.time() < deadline:
            time.sleep(0.05)
        kept = {p.pid for p in cluster_processes(before, {root.pid})}
        child = {c.pid for c in psutil.Process(root.pid).children()}
        assert root.pid in kept and child and child <= kept and stray.pid not in kept
        assert stray.pid in {p.pid for p in cluster_processes(before)}
    finally:
        for p in psutil.Process(root.pid).children() + [psutil.Process(root.pid), psutil.Process(stray.pid)]:
            p.kill()
        root.wait()
        stray.wait()


def _all_reduce_world():
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))


def _rank_plus_one():
    import torch.distributed as dist

    return dist.get_rank() + 1


HOLD_UP = """import time
import torch, torch.distributed as dist
if rank == 1:
    time.sleep(1000)
dist.all_reduce(torch.ones(1))
"""


def test_a_stuck_or_partial_collective_says_where_and_marks_the_cluster(monkeypatch):
    """1. Rank 1 never enters the all-reduce rank 0 waits in: the timeout's error says where each rank is, from its
    Python stack (SIGUSR1 to faulthandler, relayed as its stderr), in the cell's own lines; what each rank printed
    is kept without those stacks. (ipykernel relays what an engine writes to its stderr's fd only outside pytest:
    the engines here start without pytest's variable, as a notebook's do.)
    2. ``ranks=[0]`` running a collective of the whole world: rank 0 fails at the collective timeout. The error says
    that the call ran on some ranks only, and the cluster is marked for restart (its process group is unusable
    after the timeout; before, it reported itself healthy and the next step failed with a misleading "collectives
    differ between ranks"). 3. Rank 0 alone in an all-reduce that rank 1 skipped (``if rank == 0:``): when the
    collective times out, the error says that rank 1 finished the call without entering it."""
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    with Cluster(n=2, timeout=180, collective_timeout=6) as cluster:
        assert cluster._relays == {0, 1}  # remote.probe: both engines' fd 2 watched
        with pytest.raises(ck.RankTimeout) as info:
            cluster.execute(HOLD_UP, timeout=3)
        text = str(info.value)
        assert "    rank 1: cell line 4: time.sleep(1000)" in text, text
        assert "    rank 0: cell line 5: dist.all_reduce(torch.ones(1)) (inside " in text, text
        assert not any("most recent call first" in o.stderr for o in info.value.outputs.values())
        cluster.restart()
        with pytest.raises(ck.RankError) as info:
            cluster.run(_all_reduce_world, ranks=[0], timeout=60)
        text = str(info.value)
        assert "this ran on ranks [0] only: a collective of a group that holds ranks [1] too" in text, text
        assert cluster.needs_restart and "NEEDS RESTART" in cluster.status()
        cluster.restart()
        with pytest.raises(ck.RankError) as info:  # rank 0 alone in an all-reduce; rank 1 done with the cell
            cluster.execute("import torch, torch.distributed as dist\nif rank == 0:\n    dist.all_reduce(torch.ones(1))",
                            timeout=60)
        text = str(info.value)
        assert "ranks [1] finished this call without entering the collective ranks [0] waited in: every rank of a " \
            "group must call each of its collectives" in text, text
        assert cluster.needs_restart
        cluster.restart()
        assert cluster.run(_rank_plus_one) == [1, 2]


def test_where_waits_for_no_stack_an_engine_cannot_relay(cluster, monkeypatch):
    """Under pytest ipykernel does not relay what an engine writes to its fd 2 (``remote.probe`` says so: its
    "relays"), so the stack a timeout asks for goes to the engine's log: ``_where`` returns at once instead of
    waiting its 2 s for output that cannot come (every timeout or peer failure of this session paid them)."""
    from types import SimpleNamespace

    import colab_kit.notebook.cluster.gather as gather

    assert cluster._relays == frozenset()

    def no_sleep(seconds):
        raise AssertionError(f"_where waited ({seconds} s) for a stack no engine relays")

    pending = {0: cluster._apply([0], _rank_plus_one)[0]}
    pending[0].get(timeout=60)
    monkeypatch.setattr(gather, "time", SimpleNamespace(sleep=no_sleep, monotonic=time.monotonic))
    assert cluster._where(pending) == ""


def test_status_admits_an_engine_killed_between_calls(cluster):
    """An engine killed while no call runs (the OOM killer between two cells): ``status()`` and ``needs_restart``
    say so before the next cell finds it (the engine's nanny tells the controller; no engine is asked)."""
    assert "NEEDS RESTART" not in cluster.status()
    pid = cluster.ranks()[2]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not cluster.needs_restart and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.needs_restart
    assert "NEEDS RESTART (the engines of ranks [2] are gone (killed, or out of memory?))" in cluster.status()


def test_a_new_config_leaves_the_engines_of_the_old_one_working(cluster):
    """``boost(..., mesh=mesh)`` on the cluster's predefined mesh holds it: a new ``set_config`` (``%colossal
    config``) gives the cluster's hold back without destroying the groups a live engine steps on. Before, the old
    engine's next step failed with "this mesh was released with the last engine (engine.close())", though none
    was closed. A mesh that is released by then is refused at boost, saying why."""
    cluster.set_config(ck.ParallelConfig(dp=4))
    boost = ("import torch, colab_kit as ck\nfrom colab_kit.models import GPT, GPTConfig\n"
             "from colab_kit.datasets import SyntheticTokens\n"
             "CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)\n"
             "batch = SyntheticTokens(64, 16, seed=0).batch(0, 8)\n"
             "torch.manual_seed(0)\n"
             "old = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), config, mesh=mesh)\n"
             "first = old.train_step(batch)\nold_mesh = mesh\n")
    cluster.execute(boost)
    cluster.set_config(ck.ParallelConfig(dp=2, tp=2))
    out = cluster.execute("second = old.train_step(batch)\nprint(second < first, config.describe())")
    assert [o.stdout for o in out.values()] == ["True dp=2 x tp=2 (1d) = 4 ranks\n"] * 4
    out = cluster.execute("old.close()\nprint(old_mesh.closed)\n"
                          "try:\n    ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), old.config, mesh=old_mesh)\n"
                          "except ck.ConfigError as e:\n    print(e)\n"
                          "new = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), config, mesh=mesh)\n"
                          "print(round(new.train_step(batch), 4) == round(first, 4))\nnew.close()\n")
    text = out[0].stdout
    assert text.startswith("True\nthe mesh given (dp=4 = 4 ranks) was released (its last engine closed, or the "
                           "cluster's config changed since it was built)"), text
    assert text.endswith("True\n"), text


def test_calls_and_configs_given_the_wrong_way_are_refused_before_anything_is_sent(cluster):
    """A timeout that is not positive, ranks that are not a list of ranks, something that is not a function or
    code: refused in the kernel, saying what would work. One rank as a number, a config as its words or its
    fields: taken as meant."""
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises(ClusterError, match="timeout"):
            cluster.run(_rank_plus_one, timeout=bad)
    with pytest.raises(ClusterError, match="timeout"):
        cluster.execute("1", timeout=0)
    with pytest.raises(ClusterError, match=r"ranks is a list of rank numbers, e.g. ranks=\[0, 1\], got '0'"):
        cluster.run(_rank_plus_one, ranks="0")
    with pytest.raises(ClusterError, match=r"ranks \[True\] are not ranks"):
        cluster.run(_rank_plus_one, ranks=[True])
    with pytest.raises(ClusterError, match="run takes a function to call on the ranks, got int"):
        cluster.run(5)
    with pytest.raises(ClusterError, match="execute takes code as a string, got function"):
        cluster.execute(_rank_plus_one)
    with pytest.raises(ClusterError, match="set_config takes a ck.ParallelConfig"):
        cluster.set_config(4)
    assert cluster.run(_rank_plus_one, ranks=2) == {2: 3}
    cluster.set_config("dp=2 tp=2")
    assert cluster.config == ck.ParallelConfig(dp=2, tp=2)
    cluster.set_config({"dp": 4})
    assert cluster.execute("print(config.describe())", ranks=[3])[3].stdout == "dp=4 = 4 ranks\n"
    assert not cluster.needs_restart

"""Local engines forked from the kernel's fork server (colab_kit/notebook/cluster/forked.py), tier 3."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from colab_kit.notebook.cluster import forked
from colab_kit.notebook.cluster.watchdog import wait_ended


def _where_am_i():
    import os
    import sys

    return dict(pid=os.getpid(), parent=os.getppid(), session=os.getsid(0), argv=sys.argv, cwd=os.getcwd())


def test_local_engines_are_forked_from_the_kernels_server(cluster):
    """Each rank is a child of this process's fork server, in a session of its own (the kernel's signals are not
    its own), running ipyparallel's engine program (an engine started as an interpreter has the path of
    ``ipyparallel/engine/__main__.py`` as its ``argv[0]``), with one child, its nanny, forked from it; the
    controller beats every 0.5 s, and the engines allow 175 missed checks of it."""
    server = forked.server_pid()
    assert server is not None and psutil.Process(server).ppid() == os.getpid()
    seen = cluster.run(_where_am_i)
    assert [s["pid"] for s in seen] == [row["pid"] for row in cluster.ranks()]
    for s in seen:
        assert s["parent"] == server and s["session"] == s["pid"] and s["argv"][0] == "ipyparallel.engine", s
        assert "--IPEngine.max_heartbeat_misses=175" in s["argv"], s  # 175 x 1 s checks: the same 175 s as before
        # its nanny (which relays signals: test_interrupt_reaches_the_ranks) forked by it, not a new interpreter
        nanny, = psutil.Process(s["pid"]).children()
        assert nanny.cmdline() == psutil.Process(server).cmdline() and os.getsid(nanny.pid) == nanny.pid, nanny
    controller = [" ".join(p.cmdline()) for p in cluster._controller_procs if "ipyparallel.controller" in " ".join(p.cmdline())]
    assert controller and all("--HeartMonitor.period=500" in c for c in controller), controller


def test_a_restart_forks_in_the_kernels_directory_now_from_a_live_server(cluster, tmp_path, monkeypatch):
    """After a ``%cd`` the next engines start in the kernel's new directory (as ipyparallel's own launcher
    starts them), not the server's; a server that died since the start (killed, out of memory) is replaced
    before the engines are forked, and is the kernel's, not one of the cluster's processes (the cluster's stop
    would end it)."""
    old = forked.server_pid()
    os.kill(old, signal.SIGKILL)
    forked._SERVER.proc.wait()
    monkeypatch.chdir(tmp_path)
    cluster.restart()
    new = forked.server_pid()
    assert new is not None and new != old
    assert new not in {p.pid for p in cluster._engine_procs}
    for s in cluster.run(_where_am_i):
        assert s["cwd"] == str(tmp_path) and s["parent"] == new, s


def test_forking_is_for_local_engines_and_can_be_turned_off(monkeypatch):
    assert forked.forking("local") and not forked.forking("ssh") and not forked.forking("mpi")
    assert not forked.forking("ipyparallel.cluster.launcher.LocalEngineSetLauncher")  # ipyparallel's, by name
    monkeypatch.setenv("COLAB_KIT_FORK_ENGINES", "0")
    assert not forked.forking("local")


def test_a_dead_server_is_replaced_a_bad_request_answered_and_end_of_input_ends_it(tmp_path, monkeypatch):
    """A server that died (killed by hand, out of memory) is started again on the next request; a fork that
    cannot run its engine (a missing working directory) ends that child alone, reaped, with the reason in its
    log and its exit code (1) written down for the kernel; a server whose input closes (its kernel exited, however) exits. On spare servers: the kernel's own
    keeps serving the session's cluster."""
    spare = forked.ForkServer()
    monkeypatch.setattr(forked, "_SERVER", spare)
    assert forked.fork_server() is spare
    os.kill(spare.pid, signal.SIGKILL)
    spare.proc.wait()
    assert not spare.alive and forked.server_pid() is None
    fresh = forked.fork_server()
    try:
        assert fresh is not spare and fresh.alive and forked.server_pid() == fresh.pid
        log = tmp_path / "engine.log"
        pid = fresh.fork([], dict(os.environ), str(tmp_path / "missing"), str(log))
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(pid), "the server reaps a child that ended: no zombie is left"
        assert "FileNotFoundError" in log.read_text() and fresh.alive
        assert fresh.exit_code(pid) == 1 and fresh.exit_code(os.getpid(), wait=0) is None  # its child, not another
        exits = fresh.exits
    finally:
        fresh.close()  # what the kernel's exit does: end of input
    assert fresh.proc.returncode == 0 and not os.path.exists(exits)  # the exit statuses' directory removed


def _slow_optimizer(params):
    time.sleep(600)
    return None


def test_a_dry_run_in_a_kernel_forks_from_its_engine_server(tmp_path):
    """Where the kernel's fork server runs (``%load_ext colab_kit`` starts it), ``ck.dry_run`` forks its child
    from it (``launch.warm``'s registered forker) instead of starting a second server: the report is the same
    as the launch forkserver's, the child is one of the server's and exited 0; a dry run past its timeout is
    killed through it, and the kernel's server keeps serving."""
    import colab_kit as ck
    from colab_kit.launch.warm import _FORKERS
    from colab_kit.models import GPTConfig

    cfg, config = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2), ck.ParallelConfig(dp=2, tp=2)
    server = forked.fork_server()
    before = set(server.forked)
    report = ck.dry_run(cfg, config, rank=3, hardware=[])
    [pid] = server.forked - before
    assert server.exit_code(pid) == 0
    saved = list(_FORKERS)
    _FORKERS.clear()  # the same dry run through ck.launch's forkserver
    try:
        assert ck.dry_run(cfg, config, rank=3, hardware=[]).memory == report.memory
    finally:
        _FORKERS[:] = saved
    before = set(server.forked)
    try:
        ck.dry_run(cfg, config, rank=1, hardware=[], timeout=1.5, optimizer=_slow_optimizer)
        raise AssertionError("a dry run past its timeout returned")
    except ck.RankTimeout as err:
        assert "rank 1" in str(err) and "1.5 s" in str(err)
    [pid] = server.forked - before
    assert server.exit_code(pid, wait=10) == -signal.SIGKILL and server.alive


def test_a_kernel_with_a_cluster_shuts_down_cleanly_and_leaves_nothing():
    """Jupyter shuts a kernel down by asking it to, and ipykernel first ends every child in its process group.
    The fork server lives in a session of its own: with it in the kernel's group, the kernel waited on it as
    a zombie until Jupyter sent SIGTERM (exit code -15 after 2.6 s, the kernel's atexit handlers skipped).
    ``%load_ext colab_kit`` has started the server already (``forked.prestart``), and an engine forked from it
    starts with what its first ``boost`` and ``%%colossal`` cell import (``WARM_MODULES``)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kernel = km.provisioner.process
        seen = []
        for code in ("%load_ext colab_kit\nfrom colab_kit.notebook.cluster import forked; print(forked.server_pid())",
                     "%colossal start -n 2",
                     "%%colossal\nimport sys\nfrom colab_kit.notebook.cluster.forked_server import WARM_MODULES\n"
                     "print('not imported:', [m for m in WARM_MODULES if m not in sys.modules])",
                     "import os; "
                     "print(forked.server_pid(), os.getsid(forked.server_pid()), os.getsid(0), forked._SERVER.exits)"):
            reply = kc.execute_interactive(code, timeout=120, output_hook=lambda m: seen.append(
                m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
            assert reply["content"]["status"] == "ok", (code, seen)
        assert seen[0].strip() != "None", seen  # started by %load_ext, before any cluster
        assert any("[ranks 0, 1]\nnot imported: []" in text for text in seen), seen  # both ranks, one output
        *ids, exits = seen[-1].split()
        server, server_session, kernel_session = map(int, ids)
        assert os.path.isdir(exits)
        assert server_session != kernel_session
        procs = [psutil.Process(server)] + psutil.Process(server).children(recursive=True)
        assert len(procs) >= 3, procs  # the server and its two engines
        # jupyter_client sends SIGTERM half way through ``shutdown_wait_time`` (5 s): beside another test worker
        # the kernel's own orderly end (its cluster stopped, the server ended) can take longer than 2.5 s, and
        # this test is about how the kernel ends, not how fast
        km.shutdown_wait_time = 60.0
        km.shutdown_kernel(now=False)
        assert kernel.wait() == 0, kernel.returncode  # asked, and it exited: not terminated (-15) nor killed (-9)
        _, left = wait_ended(procs, 30)
        assert left == [], left
        assert not os.path.exists(exits)  # the server removes its exit statuses' directory as it ends
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def test_a_killed_kernels_server_ends_and_removes_its_directory():
    """A kernel killed outright (SIGKILL, out of memory) never closes its server: the server sees its input end,
    exits and removes the directory of exit statuses itself (one was left in /tmp for every such kernel)."""
    code = ("import os, signal; from colab_kit.notebook.cluster import forked; s = forked.fork_server(); "
            "print(s.pid, s.exits, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, exits = proc.stdout.split()
    deadline = time.monotonic() + 30
    while (psutil.pid_exists(int(pid)) or os.path.exists(exits)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(exits), exits

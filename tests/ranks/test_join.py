"""``ck.init()`` (``colab_kit.join``): the launchers' environments read into one view, with clear errors;
a script with ``ck.init()`` trained under torchrun on this host to one process's losses. An unreachable
rendezvous is a clear error within the timeout. (Two hosts for real, network namespaces: test_two_hosts.py.)
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import colab_kit as ck
from colab_kit.config import ConfigError
from colab_kit.join import detect, first_host

from tests.helpers import (TORCHRUN_SCRIPT as SCRIPT, TORCHRUN_STEPS as STEPS, torchrun as _torchrun,
                           torchrun_reference as reference)


# ---------------------------------------------------------------------- the environments, no processes
def test_each_launcher_is_read_into_one_view():
    tr = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (tr.launcher, tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port, tr.single_host) == \
        ("torchrun", 3, 4, 1, "10.0.0.1", 29500, False)
    sl = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
                 "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "4"})
    assert (sl.launcher, sl.rank, sl.world_size, sl.local_rank, sl.master_addr, sl.master_port, sl.source) == \
        ("slurm", 5, 8, 1, "gpu07", 20000 + 123456 % 20000, "SLURM_JOB_NODELIST")
    om = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (om.launcher, om.master_addr, om.master_port, om.single_host) == ("openmpi", "127.0.0.1", 29500, True)
    mp = detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "h0", "MASTER_PORT": "7"})
    assert (mp.launcher, mp.master_addr, mp.master_port) == ("mpich", "h0", 7)
    assert detect({}) is None  # a plain `python train.py`
    assert first_host("n[1-4]") == "n1" and first_host("login") == "login"


def test_the_exit_hook_waits_while_another_thread_runs_and_no_longer(monkeypatch):
    """``_leave``'s wait (``_settle``), checked by what happened in which order, not by how long it took
    (a loaded machine stretches every sleep): with only this thread it returns through its quiet looks,
    before its limit; while another thread spins (as a gloo worker finishing its last collective would), it
    keeps looking until that thread has ended, and returns then; and a thread that never ends holds it no
    longer than the limit: it returns with that thread still running.

    The spinning thread stops after ``_settle`` has looked ``LOOKS`` times (its sleeps are counted), so
    "waited for it" means: it had ended when ``_settle`` returned, and ``_settle`` looked that often."""
    import threading
    import time

    from colab_kit.join import _settle

    assert _settle(limit=60) < 60  # two quiet looks, not the limit (nothing but this thread runs here)

    LOOKS = 20
    looks, real_sleep = [0], time.sleep

    def counted_sleep(seconds):
        looks[0] += 1
        real_sleep(seconds)
    monkeypatch.setattr(time, "sleep", counted_sleep)  # _settle imports time afresh: it sleeps through this

    def spinner(stop, ended, give_up):
        """Runs (never blocks) until ``stop`` says so; ``give_up`` only keeps a broken _settle from hanging."""
        while not stop() and time.monotonic() < give_up:
            pass
        ended.set()

    # while another thread runs: waited until it ended
    ended = threading.Event()
    t = threading.Thread(target=spinner, args=(lambda: looks[0] >= LOOKS, ended, time.monotonic() + 120))
    looks[0] = 0
    t.start()
    waited = _settle(limit=600)
    seen, done = looks[0], ended.is_set()
    t.join()
    assert done and seen >= LOOKS and waited < 600, (done, seen, waited)

    # a thread that never ends: given up at the limit, the thread still running
    ended, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=spinner, args=(stop.is_set, ended, time.monotonic() + 120))
    t.start()
    waited = _settle(limit=0.3)
    still_running = not ended.is_set()
    stop.set()
    t.join()
    assert still_running and waited >= 0.3, (still_running, waited)


@pytest.mark.parametrize("env, rule", [
    ({"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "torchrun sets WORLD_SIZE, and it is missing"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=4 is outside 0..3"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "LOCAL_RANK=2 is inconsistent"),
    ({"RANK": "1", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}, "WORLD_SIZE='two' .* is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a"}, "MASTER_PORT is missing"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "mpirun -x MASTER_ADDR"),
])
def test_missing_or_inconsistent_variables_are_named(env, rule):
    with pytest.raises(ConfigError, match=rule):
        detect(env)


def test_a_world_size_that_disagrees_with_the_config_is_refused_before_connecting(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"the config is dp=2 x tp=2 \(1d\) = 4 ranks, and this job has WORLD_SIZE=2 from "
                                          r"torchrun: start 4 ranks \(torchrun --nproc-per-node 4\)"):
        ck.init(ck.ParallelConfig(dp=2, tp=2))


def test_torchrun_with_more_ranks_than_gpus_is_refused_before_connecting(monkeypatch):
    """Two ranks on a host with one GPU under torchrun (which binds no GPU per rank): both would take
    cuda:0, and NCCL would fail later with "duplicate GPU"; refused here, saying what to start instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) on a refused job"))
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"2 ranks on this host and 1 GPUs: NCCL needs one GPU per rank; start one "
                                          r"rank per GPU \(torchrun --nproc-per-node 1\)"):
        ck.init()


def test_an_unreachable_rendezvous_is_a_clear_error_within_the_timeout():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               CK_TEST_TIMEOUT="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "dp=2", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert f"rank 1 could not reach the rendezvous at 127.0.0.1:{port} (from MASTER_ADDR, torchrun) within 1 s" \
        in run.stderr, run.stderr[-2000:]


# ---------------------------------------------------------------------- torchrun on this host
def test_a_script_with_init_trains_under_torchrun_like_one_process():
    want = reference()
    for words, n in (("dp=2 tp=2", 4),):
        run = subprocess.run(_torchrun(["--standalone", f"--nproc-per-node={n}"]) + [words, str(STEPS)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        lines = run.stdout.strip().splitlines()
        got = json.loads(next(line for line in lines if line.startswith("{")))
        assert run.stdout.count("AT EXIT the process group is destroyed") == n, run.stdout  # ck.init's exit hook ran
        assert got["world_size"] == n and got["backend"] == "nccl_rules" and got["launcher"] == "torchrun"
        assert set(got["ifnames"]) == {"lo"}  # every rank on this host: gloo stays on loopback
        assert got["losses"] == pytest.approx(want, rel=1e-5)


def test_the_innermost_launcher_wins_and_gloo_never_takes_loopback_across_hosts(monkeypatch):
    """mpirun inside an sbatch job: Open MPI's variables, not the batch step's SLURM_PROCID; a rendezvous
    hostname that resolves to loopback here, on a multi-host job: the default route's interface, never lo."""
    import colab_kit.join as join
    both = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "h0"}
    assert detect(both).launcher == "openmpi" and detect(both).rank == 3
    job = detect({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "hostA", "MASTER_PORT": "1"})
    monkeypatch.setattr(join, "interface_for", lambda addr: "lo" if addr == "hostA" else "eth7")
    assert join.gloo_interface(job) == "eth7"
    monkeypatch.setattr(join, "interface_for", lambda addr: "lo")
    with pytest.raises(ConfigError, match="set GLOO_SOCKET_IFNAME"):
        join.gloo_interface(job)
    single = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "hostA", "MASTER_PORT": "1"})
    assert join.gloo_interface(single) == "lo"  # every rank here: loopback, whatever the name resolves to


def test_exported_scripts_keep_cells_byte_for_byte_and_parse():
    import ast
    from colab_kit.notebook.magics.export import export_script
    cell = 'x = 1\nfor i in range(2):\n    %time y = 2\nt = """\n!keep\n   text?\n"""\nz = (x\n     % 2)\nw = 1  # kept?'
    body, world, skipped = export_script([("cell", "a = 1", None), ("config", ck.ParallelConfig(dp=2, tp=2).to_dict()),
                                          ("cell", cell, None), ("cell", 's = """a\nb"""', [0, 2])], world_size=4)
    ast.parse(body)
    assert world == 4 and skipped == ["%time y = 2"]
    assert 't = """\n!keep\n   text?\n"""' in body and "z = (x\n     % 2)" in body and "w = 1  # kept?" in body
    assert "    pass  # (IPython syntax" in body  # the loop keeps a body
    assert "ck.init()" in body and "if rank in (0, 2):\n    exec(compile('s = \"\"\"a\\nb\"\"\"'" in body
    with pytest.raises(ConfigError, match="nothing to export yet"):
        export_script([("config", ck.ParallelConfig(dp=2).to_dict())])


def test_a_cluster_across_hosts_puts_gloo_on_the_interface_that_reaches_the_rendezvous(monkeypatch):
    """``colab_kit.net.gloo_env``, what every engine of a ``ck.Cluster`` sets before joining: loopback for a
    loopback rendezvous; across hosts the interface routing to the controller's address (gloo alone would bind
    to the hostname's address, 127.0.1.1 on Debian, which the other hosts cannot reach); a user's choice kept.
    (Checked by hand across two network namespaces with ipyparallel's SSH launcher: 4 engines on 2 hosts.)"""
    import colab_kit.net as net
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert net.gloo_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": net.loopback_interface()}
    monkeypatch.setattr(net, "interface_for", lambda addr: "veth-b" if addr == "10.231.0.1" else None)
    assert net.gloo_env("10.231.0.1") == {"GLOO_SOCKET_IFNAME": "veth-b"}
    assert net.gloo_env("10.9.9.9") == {}  # cannot tell: gloo's own choice, as before
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth3")
    assert net.gloo_env("10.231.0.1") == {}

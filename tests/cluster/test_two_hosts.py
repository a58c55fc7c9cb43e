"""Two hosts on one machine, for real: network namespaces A and B joined by a veth pair, with addresses
only inside them, removed afterwards (root only, as in CI; skipped with the reason elsewhere).

- torchrun ``--nnodes 2`` in each namespace with ``ck.init()``: gloo finds each host's interface by itself;
  dp x pp and dp x tp train to one process's losses.
- A notebook's cluster across both: an sshd per host (its own hostname, keys made in a temporary directory),
  ``%colossal start --engines ssh`` with the controller on A, ``%%colossal`` cells training dp x tp to one
  process's losses, nothing listening beyond each host's own address, an engine on B killed mid-step
  (reported with its rank and host), ``%colossal restart`` and the same cell again.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TORCHRUN_STEPS as STEPS, torchrun as _torchrun, torchrun_reference as reference
from tests.helpers.two_hosts import HostsUnavailable, namespaces, sshds

SSH_DRIVER = Path(__file__).resolve().parents[1] / "scripts" / "ssh_cluster.py"


@pytest.fixture(scope="module")
def two_hosts():
    """Namespaces A and B joined by a veth pair, 10.231.<n>.1 and .2, removed afterwards."""
    try:
        with namespaces() as hosts:
            yield hosts
    except HostsUnavailable as e:
        pytest.skip(str(e))


def test_torchrun_across_two_hosts_trains_like_one_process(two_hosts):
    """torchrun --nnodes 2 in two namespaces: 2 ranks on each host, the rendezvous on host A's address;
    gloo's interface on each host found by ck.init() (nothing set by hand)."""
    want = reference()
    h = two_hosts
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    for i, words in enumerate(("dp=2 pp=2", "dp=2 tp=2")):
        port = str(29600 + i)
        common = ["--nnodes=2", "--nproc-per-node=2", f"--master-addr={h['addr_a']}", f"--master-port={port}"]
        procs = [subprocess.Popen(_torchrun(common + [f"--node-rank={r}"], prefix=("ip", "netns", "exec", h[ns]))
                                  + [words, str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r, ns in ((0, "A"), (1, "B"))]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=180))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        assert all(p.returncode == 0 for p in procs), "\n".join(
            f"host {ns} ({words}) exited {p.returncode}:\n{out[-2000:]}{err[-6000:]}"
            for ns, p, (out, err) in zip("AB", procs, outs))  # both hosts: the one that failed first may be B
        got = json.loads(next(line for line in outs[0][0].splitlines() if line.startswith("{")))
        assert all(out.count("AT EXIT the process group is destroyed") == 2 for out, _ in outs), outs
        assert got["world_size"] == 4
        assert got["ifnames"] == [h["dev_a"], h["dev_a"], h["dev_b"], h["dev_b"]], got["ifnames"]
        assert got["losses"] == pytest.approx(want, rel=1e-5), words


@pytest.fixture(scope="module")
def ssh_hosts(two_hosts, tmp_path_factory):
    """An sshd in each namespace (hostnames ck-host-a and ck-host-b) and a profile that reaches both."""
    try:
        with sshds(two_hosts, tmp_path_factory.mktemp("ssh")) as hosts:
            yield hosts
    except HostsUnavailable as e:
        pytest.skip(str(e))


def test_an_ssh_cluster_across_two_hosts_trains_survives_a_dead_engine_and_restarts(ssh_hosts):
    h = ssh_hosts
    want = reference()
    args = json.dumps({"addr_a": h["addr_a"], "addr_b": h["addr_b"], "profile": h["profile"]})
    run = subprocess.run(["ip", "netns", "exec", h["A"], sys.executable, str(SSH_DRIVER), args],
                         capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert lines, run.stdout[-3000:] + run.stderr[-3000:]
    seen = json.loads(lines[-1])
    assert run.returncode == 0 and "failed" not in seen, seen
    print({k: round(v, 1) for k, v in seen.items() if k.endswith("_s")})

    # ranks contiguous per host: rank 0, 1 on A and 2, 3 on B, so each tp pair is inside one host
    assert seen["hosts"] == ["ck-host-a"] * 2 + ["ck-host-b"] * 2, seen["start_output"]
    assert "started 4 ranks (ssh engines, nccl_rules)" in seen["start_output"]
    # each engine forked by its host's fork server (ssh_forked), before and after the restart
    assert all("forked_server" in p for p in seen["parents"] + seen["parents_after"]), seen["parents"]
    for rank_losses in seen["losses"]:
        assert rank_losses == pytest.approx(want, rel=1e-5)

    # nothing listens beyond loopback and each host's own address: not 0.0.0.0, not the other host's
    own = {"ck-host-a": h["addr_a"], "ck-host-b": h["addr_b"]}
    for host, addrs in seen["engines_listen"]:
        assert addrs and set(addrs) <= {own[host], "127.0.0.1", "::1"}, (host, addrs)
    assert any(own["ck-host-b"] in addrs for host, addrs in seen["engines_listen"] if host == "ck-host-b")
    assert h["addr_a"] in seen["controller_listen"]
    assert set(seen["controller_listen"]) <= {h["addr_a"], "127.0.0.1", "::1"}, seen["controller_listen"]

    # the engine killed on host B: its rank and host first, within seconds, and a restart asked for
    text = seen["kill_error"] + "\n" + seen["kill_output"]
    assert seen["kill_error"].startswith("RankError"), text
    assert "rank 3 failed" in text and "engine process died" in text and "on host 'ck-host-b'" in text, text
    assert "killed by SIGKILL" in text, text  # how it ended, as host B's fork server wrote it
    assert seen["kill_s"] < 60 and seen["needs_restart"], seen["kill_s"]

    # restarted: fresh engines on the same hosts, the same cell trains like one process again
    assert seen["hosts_after"] == seen["hosts"] and set(seen["pids_after"]).isdisjoint(seen["pids"])
    for rank_losses in seen["losses_after"]:
        assert rank_losses == pytest.approx(want, rel=1e-5)

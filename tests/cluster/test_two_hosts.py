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
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import TORCHRUN_STEPS as STEPS, torchrun as _torchrun, torchrun_reference as reference

SSH_DRIVER = Path(__file__).resolve().parents[1] / "scripts" / "ssh_cluster.py"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _end_everything_in(ns: str) -> None:
    """SIGKILL what still runs in namespace ``ns`` (an sshd's sessions, an engine left behind)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture(scope="module")
def two_hosts():
    """Namespaces A and B joined by a veth pair, 10.231.<n>.1 and .2, removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two hosts need network namespaces: root and iproute2's `ip` (CI runs as root)")
    tag = f"{os.getpid() % 100000}"
    a, b, va, vb = f"ckA{tag}", f"ckB{tag}", f"ckva{tag}", f"ckvb{tag}"
    net = f"10.231.{os.getpid() % 250}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        _ip("-n", a, "addr", "add", f"{net}.1/24", "dev", va)
        _ip("-n", b, "addr", "add", f"{net}.2/24", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in (a, b):
            _ip("netns", "del", ns, check=False)
        pytest.skip(f"network namespaces cannot be made here: {getattr(e, 'stderr', e)}")
    yield {"A": a, "B": b, "addr_a": f"{net}.1", "addr_b": f"{net}.2", "dev_a": va, "dev_b": vb}
    for ns in (a, b):
        _end_everything_in(ns)
        _ip("netns", "del", ns, check=False)
    assert not {a, b} & set(_ip("netns", "list").stdout.split())


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


# ---------------------------------------------------------------------- an sshd on each host
SSHD_CONFIG = """\
ListenAddress {addr}
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/authorized_keys
PidFile {dir}/sshd-{name}.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
Subsystem sftp /usr/lib/openssh/sftp-server
"""
PROFILE = """\
# what a user's ~/.ssh/config would say: the key, no prompt for the hosts' keys, and one connection per
# host shared by ipyparallel's many ssh calls (its launcher runs several for every engine it starts)
opts = ["-i", {key!r}, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
        "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "ControlMaster=auto",
        "-o", "ControlPath={control}/%C", "-o", "ControlPersist=30"]
c.SSHLauncher.ssh_args = opts
c.SSHLauncher.scp_args = opts
c.SSHLauncher.user = "root"
c.SSHLauncher.remote_python = {python!r}
c.SSHLauncher.remote_profile_dir = {remote!r}
"""


@pytest.fixture(scope="module")
def ssh_hosts(two_hosts, tmp_path_factory):
    """An sshd in each namespace on its own address only, in its own UTS namespace: hostnames ck-host-a and
    ck-host-b, so the engines it starts are on different hosts by every measure ipyparallel and colab_kit
    take. Keys and configs in a temporary directory; the sshds and their sessions ended afterwards."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd) or shutil.which("ssh") is None or shutil.which("unshare") is None:
        pytest.skip("the SSH launcher test needs openssh-server, openssh-client and unshare "
                    "(.ci/run installs openssh-server with apt-get)")
    d = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    procs = []
    for name, ns, addr in (("a", two_hosts["A"], two_hosts["addr_a"]), ("b", two_hosts["B"], two_hosts["addr_b"])):
        cfg = d / f"sshd-{name}.conf"
        cfg.write_text(SSHD_CONFIG.format(addr=addr, dir=d, name=name))
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                                       f"hostname ck-host-{name} && exec {sshd} -D -e -f {cfg}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    profile = d / "profile_ck"
    profile.mkdir()
    (profile / "ipcluster_config.py").write_text(PROFILE.format(key=str(d / "user_key"), python=sys.executable, control=d,
                                                                remote=str(d / "remote_profile")))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all((d / f"sshd-{n}.pid").exists() for n in "ab"):
        if any(p.poll() is not None for p in procs):
            pytest.fail("sshd did not start: " + " ".join(p.stderr.read() for p in procs if p.poll() is not None))
        time.sleep(0.05)
    yield {**two_hosts, "profile": str(profile)}
    for p in procs:
        p.kill()
        p.wait()
    for ns in (two_hosts["A"], two_hosts["B"]):
        _end_everything_in(ns)


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
    assert seen["kill_s"] < 60 and seen["needs_restart"], seen["kill_s"]

    # restarted: fresh engines on the same hosts, the same cell trains like one process again
    assert seen["hosts_after"] == seen["hosts"] and set(seen["pids_after"]).isdisjoint(seen["pids"])
    for rank_losses in seen["losses_after"]:
        assert rank_losses == pytest.approx(want, rel=1e-5)

"""Two hosts on one machine, for real: network namespaces A and B joined by a veth pair, with addresses only
inside them, and an sshd in each (its own hostname, keys made in a temporary directory). Root only; each
context manager removes what it made. ``tests/cluster/test_two_hosts.py`` and ``bench/ssh.py`` use them.

    with namespaces() as h:                       # h["A"], h["addr_a"], h["dev_a"], ... (10.231.<n>.1 and .2)
        with sshds(h, tmp) as s:                  # s["profile"]: an ipyparallel profile that reaches both
            ...
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["HostsUnavailable", "namespaces", "sshds", "end_everything_in"]


class HostsUnavailable(RuntimeError):
    """This machine cannot make the two hosts (not root, no iproute2 or openssh); the message says which."""


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def end_everything_in(ns: str) -> None:
    """SIGKILL what still runs in namespace ``ns`` (an sshd's sessions, an engine left behind)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@contextlib.contextmanager
def namespaces():
    """Namespaces A and B joined by a veth pair, 10.231.<n>.1 and .2, removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise HostsUnavailable("two hosts need network namespaces: root and iproute2's `ip` (CI runs as root)")
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
        raise HostsUnavailable(f"network namespaces cannot be made here: {getattr(e, 'stderr', e)}") from e
    try:
        yield {"A": a, "B": b, "addr_a": f"{net}.1", "addr_b": f"{net}.2", "dev_a": va, "dev_b": vb}
    finally:
        for ns in (a, b):
            end_everything_in(ns)
            _ip("netns", "del", ns, check=False)
    assert not {a, b} & set(_ip("netns", "list").stdout.split())


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


@contextlib.contextmanager
def sshds(hosts: dict, d: Path):
    """An sshd in each namespace of ``hosts`` on its own address only, in its own UTS namespace: hostnames
    ck-host-a and ck-host-b, so the engines it starts are on different hosts by every measure ipyparallel and
    colab_kit take. Keys, configs and the ipyparallel profile (``profile``) in ``d``; the sshds and their
    sessions ended afterwards."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd) or shutil.which("ssh") is None or shutil.which("unshare") is None:
        raise HostsUnavailable("the SSH launcher needs openssh-server, openssh-client and unshare "
                               "(.ci/run installs openssh-server with apt-get)")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    procs = []
    try:
        for name, ns, addr in (("a", hosts["A"], hosts["addr_a"]), ("b", hosts["B"], hosts["addr_b"])):
            cfg = d / f"sshd-{name}.conf"
            cfg.write_text(SSHD_CONFIG.format(addr=addr, dir=d, name=name))
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                                           f"hostname ck-host-{name} && exec {sshd} -D -e -f {cfg}"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        profile = d / "profile_ck"
        profile.mkdir()
        (profile / "ipcluster_config.py").write_text(PROFILE.format(
            key=str(d / "user_key"), python=sys.executable, control=d, remote=str(d / "remote_profile")))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all((d / f"sshd-{n}.pid").exists() for n in "ab"):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("sshd did not start: " + " ".join(p.stderr.read() for p in procs
                                                                     if p.poll() is not None))
            time.sleep(0.05)
        yield {**hosts, "profile": str(profile)}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for ns in (hosts["A"], hosts["B"]):
            end_everything_in(ns)

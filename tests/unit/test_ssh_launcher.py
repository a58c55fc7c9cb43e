"""The SSH engine launcher's shell side (``colab_kit/notebook/cluster/ssh.py``), run in a local ``sh`` in place of
ssh: waiting on an engine with ``kill -0``, its log in one call, a host's later engines on its first engine's
sender. The whole launcher over real ssh is ``tests/cluster/test_two_hosts.py``."""
from __future__ import annotations

import subprocess
import sys

import pytest

from colab_kit.notebook.cluster import ssh


class LocalShell:
    """ipyparallel's ``ShellCommandSend`` as the launcher uses it, running each command in a local ``sh``."""

    def __init__(self, shell="/bin/bash"):
        self.shell_info, self.calls, self.started = ("linux-gnu", shell), [], []

    def get_shell_info(self):
        return self.shell_info

    def check_output(self, cmd, **kwargs):
        self.calls.append(cmd)
        return subprocess.check_output(["sh", "-c", cmd], text=True)

    def cmd_start(self, cmd, env=None, output_file=None):
        self.started.append((cmd, env))
        return 4242


def _launcher(tmp_path, sender, **kw):
    el = ssh.ConcurrentSSHEngineLauncher(profile_dir=str(tmp_path), cluster_id="t", identifier="h/0", **kw)
    el._ssh_sender = sender
    return el


def test_an_engine_is_waited_on_in_the_remote_shell_until_it_ends(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        el = _launcher(tmp_path, LocalShell())
        el.pid = proc.pid
        with pytest.raises(TimeoutError):
            el.wait_one(timeout=0.3)  # still running after 3 polls
        proc.kill()
        proc.wait()
        assert el.wait_one(timeout=30) == -1  # gone: ipyparallel's exit code for a process not its own
    finally:
        proc.kill()
    assert all("kill -0" in c for c in el.ssh_sender.calls)


def test_the_engines_log_comes_back_in_one_call_and_is_removed(tmp_path):
    log = tmp_path / "engine 0.log"  # a space: the path is quoted for the shell
    log.write_text("registered as engine 3\n")
    sender = LocalShell()
    el = _launcher(tmp_path, sender, remote_output_file=str(log))
    assert el.get_output(remove=True) == "registered as engine 3\n"
    assert not log.exists() and len(sender.calls) == 1
    assert el.get_output(remove=True) == "registered as engine 3\n" and len(sender.calls) == 1  # kept


def test_a_shell_that_is_not_posix_keeps_ipyparallels_way(tmp_path, monkeypatch):
    from ipyparallel.cluster.launcher import SSHEngineLauncher

    monkeypatch.setattr(SSHEngineLauncher, "wait_one", lambda self, timeout: "ipyparallel's")
    el = _launcher(tmp_path, LocalShell(shell="powershell.exe"))
    assert el.wait_one(timeout=1) == "ipyparallel's" and el.ssh_sender.calls == []


def test_a_hosts_later_engine_starts_on_its_first_engines_sender(tmp_path):
    sender = LocalShell()
    first = _launcher(tmp_path, sender)
    later = ssh.ConcurrentSSHEngineLauncher(profile_dir=str(tmp_path), cluster_id="t", identifier="h/1",
                                            environment={ssh.SLOT: "1"})
    later.host_first = first
    later._start_waiting = lambda: None  # no background wait in this test
    later.start(hostname="node7", user="me")
    assert later.ssh_sender is sender and later.pid == 4242 and later.location == "me@node7"
    (cmd, env), = sender.started
    assert env[ssh.SLOT] == "1" and sender.calls == []  # one call: the start, nothing checked again

"""The SSH engine launcher's shell side (``colab_kit/notebook/cluster/ssh.py``), run in a local ``sh`` in place of
ssh: waiting on an engine with ``kill -0``, its log in one call, a host's later engines on its first engine's
sender. The whole launcher over real ssh is ``tests/cluster/test_two_hosts.py``."""
from __future__ import annotations

import os
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
    el.pid = 4242  # started
    assert el.get_output(remove=True) == "registered as engine 3\n"
    assert not log.exists() and len(sender.calls) == 1
    assert el.get_output(remove=True) == "registered as engine 3\n" and len(sender.calls) == 1  # kept


def test_a_shell_that_is_not_posix_keeps_ipyparallels_way(tmp_path, monkeypatch):
    from ipyparallel.cluster.launcher import SSHEngineLauncher

    monkeypatch.setattr(SSHEngineLauncher, "wait_one", lambda self, timeout: "ipyparallel's")
    el = _launcher(tmp_path, LocalShell(shell="powershell.exe"))
    el.pid = 4242
    assert el.wait_one(timeout=1) == "ipyparallel's" and el.ssh_sender.calls == []


def test_an_engine_never_started_is_not_asked_anything(tmp_path):
    """A host whose first engine failed leaves its others unstarted: their wait, log and stop ask no ssh."""
    import asyncio

    el = _launcher(tmp_path, None)  # no sender: any ssh call would fail
    assert el.wait_one(timeout=1) == -1 and el.get_output(remove=True) == ""
    asyncio.run(el.stop())


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


def test_the_set_starts_each_hosts_first_engine_then_the_rest_on_its_sender(tmp_path, monkeypatch):
    """Hosts as ipyparallel reads them (``user@host:port``, a dict with ``n``), ``n`` below their sum: each
    engine its place (``SLOT``), its own log file and its own ssh arguments (a first engine's port stays its
    host's); a host's later engines on its first engine's sender; a host whose first engine fails fails the
    start, its other engines never contacted."""
    import asyncio

    senders = {}

    def prepare(self, hostname=None, user=None, port=None):  # the first engine's checks and files (no fork server)
        self.hostname, self.user = hostname, user or self.user
        if port is not None:
            self.ssh_args.extend(["-p", port])
        if hostname == "down":
            raise RuntimeError("ssh: connect to host down port 22: No route to host")
        self._ssh_sender = senders[hostname] = LocalShell()

    monkeypatch.setattr(ssh.ConcurrentSSHEngineLauncher, "_prepare", prepare)
    monkeypatch.setattr(ssh.ConcurrentSSHEngineLauncher, "_start_waiting", lambda self: None)

    async def start(engines, n):
        es = ssh.ConcurrentSSHEngineSetLauncher(engines=engines, profile_dir=str(tmp_path), cluster_id="t")
        return es, es.start(n)

    es, ids = asyncio.run(start({"a:2222": 2, "me@b": {"n": 3}}, 4))
    assert ids == ["a:2222/0", "a:2222/1", "me@b/0", "me@b/1"]
    els = [es.launchers[i] for i in ids]
    assert [el.get_env()[ssh.SLOT] for el in els] == ["0", "1", "2", "3"]
    assert els[1].ssh_sender is senders["a"] and els[3].ssh_sender is senders["b"]
    assert [len(s.started) for s in senders.values()] == [2, 2]  # the later engine: one start on that sender
    assert "-p" in els[0].ssh_args and "-p" not in els[2].ssh_args and "-p" not in es.ssh_args
    assert len({el.remote_output_file for el in els}) == 4 and els[3].location == "me@b"

    with pytest.raises(RuntimeError, match="No route"):
        asyncio.run(start({"a": 2, "down": 2}, 4))
    assert senders["a"].started  # the healthy host started; "down"'s second engine was never contacted


def test_an_ssh_hosts_fork_server_forks_engines_and_tells_how_they_ended(tmp_path, monkeypatch):
    """``ssh_forked.RemoteForkServer`` over a local ``sh -c`` in place of ssh: the engine it forks gets the
    launcher's arguments and the login environment with the request's variables set (an empty one unset); its
    exit status comes back through the launcher's wait (one call) and through ``ssh_forked.exit_code`` by host."""
    import json
    import socket

    from colab_kit.notebook.cluster import ssh_forked

    profile = tmp_path / "profile_t"
    profile.mkdir()
    seen = tmp_path / "seen.json"
    # ipengine runs its profile's config file: it writes what the engine was given, then ends with code 7
    (profile / "ipengine_config.py").write_text(
        "import json, os, sys\n"
        f"json.dump({{'env': dict(os.environ), 'argv': sys.argv, 'cwd': os.getcwd()}}, open({str(seen)!r}, 'w'))\n"
        "print('the engine read its config', flush=True)\n"
        "os._exit(7)\n")
    monkeypatch.setenv("CK_TEST_LOGIN", "kept")
    monkeypatch.setenv("CK_TEST_UNSET", "dropped")
    monkeypatch.chdir(tmp_path)
    server = ssh_forked.RemoteForkServer(["sh", "-c"], sys.executable)
    monkeypatch.setitem(ssh_forked._SERVERS, ("sh", "-c"), server)
    try:
        el = _launcher(tmp_path, LocalShell(), remote_output_file=str(tmp_path / "engine.log"),
                       environment={ssh.SLOT: "3", "CK_TEST_UNSET": ""})
        el.server = server
        el.engine_args = [f"--profile-dir={profile}"]
        el.pid = el._launch()
        assert el.forked_by is server and el.pid in server.forked
        log = tmp_path / "engine.log"
        assert el.wait_one(timeout=60) == 7, log.read_text() if log.exists() else "no log"
        # the wait, the exit status and the log in one call; the log read and removed with it
        assert len(el.ssh_sender.calls) == 1 and not log.exists()
        assert "the engine read its config" in el.get_output(remove=True) and len(el.ssh_sender.calls) == 1
        got = json.loads(seen.read_text())
        assert got["env"][ssh.SLOT] == "3" and got["env"]["CK_TEST_LOGIN"] == "kept"
        assert "CK_TEST_UNSET" not in got["env"] and got["cwd"] == str(tmp_path)
        assert f"--profile-dir={profile}" in got["argv"]
        assert server.host == socket.gethostname()
        assert ssh_forked.exit_code(socket.gethostname(), el.pid) == 7
        assert ssh_forked.exit_code("another-host", el.pid) is None
    finally:
        server.close()
    assert not server.alive and not os.path.exists(server.exits)  # the server removed its own directory


def test_a_restart_sends_nothing_again_while_the_host_still_has_the_files(tmp_path, monkeypatch):
    """A host's first engine makes the profile and sends the files once; the next start of the same cluster (the
    same files to the same host) asks only whether they are still there (one call), and sends them again once
    they are gone."""
    from colab_kit.notebook.cluster import ssh_forked

    monkeypatch.setattr(ssh_forked, "remote_fork_server", lambda *a: None)  # no server: only the files here
    monkeypatch.setattr(ssh, "_SENT", set())
    local = tmp_path / "ipcontroller-engine.json"
    local.write_text("{}")
    remote = tmp_path / "remote" / "security" / "ipcontroller-engine.json"
    log_dir = tmp_path / "remote" / "log"
    done: list[str] = []

    def first(identifier):
        sender = LocalShell()
        sender.has_python = lambda: done.append("has_python")
        sender.check_output_python_module = lambda args: done.append("profile")
        el = _launcher(tmp_path, sender, remote_output_file=str(log_dir / "engine.out"))
        el.identifier, el.to_send = identifier, [(str(local), str(remote))]
        el.send_files = lambda: (done.append("send"), remote.parent.mkdir(parents=True, exist_ok=True),
                                 remote.write_text("{}"), log_dir.mkdir(parents=True, exist_ok=True))
        el._prepare("node7", None, None)
        return sender

    first("h/0")
    assert done == ["has_python", "profile", "send"]
    again = first("h/0")  # the restart
    assert done == ["has_python", "profile", "send"] and len(again.calls) == 1 and "test -e" in again.calls[0]
    remote.unlink()  # the host lost them (rebooted, wiped)
    first("h/0")
    assert done == ["has_python", "profile", "send"] * 2

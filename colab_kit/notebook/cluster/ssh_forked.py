"""A fork server on each SSH host: the host's engines forked from one process that has imported torch already.

Local engines are forked from a server in the kernel's machine (``forked.py``); without one, an SSH engine is a
fresh interpreter on its host that imports torch, ipyparallel and colab_kit before it registers, and every
restart pays that again, on each host. ``RemoteForkServer`` runs the same server program on the host, over
one ssh session kept open (``ssh <host> python3 -c SERVE <exits>``): the kernel writes a request a line down
that session and reads the engine's pid back. The server's imports run while the host's first engine makes the
profile and receives the connection files, and it stays for every later start and restart of the kernel's
clusters on that host. It ends when the session closes (the kernel closed it, exited or was killed: ssh closes
the remote end's input); the engines it forked run on until the cluster stops them, as before.

What the launcher gets besides speed: the server reaps each engine and writes its exit status to
``<exits>/<pid>`` on the host, so a rank whose engine died over there is reported with how it ended ("killed by
SIGKILL", ``exit_code``), as a local one is. An engine is forked only where ipyparallel would have run
``<remote_python> -m ipyparallel.engine`` on a POSIX login shell; with ``COLAB_KIT_FORK_ENGINES=0``, another
engine command, another shell, or a server that fails (colab_kit missing on the host: its import fails and
the server exits), engines start the usual way, with a warning in the cluster's log.

Worked example, ``hosts="a:2,b:2"`` (``ssh.py`` starts each host's first engine, then the rest)::

    kernel ──ssh a── server on a (torch imported)     kernel ──ssh b── server on b
        a/0: shell, profile, files -> {"argv": [...], "env": {SLOT: "0", ...}, "merge_env": true}  <- {"pid": 811}
        a/1:                          {... SLOT: "1" ...}                                            <- {"pid": 812}
        (b the same, at the same time); rank 3's engine SIGKILLed: "-9" in b:/tmp/colab_kit-exits-.../<pid>
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import shlex
import subprocess
import threading

from .forked import SERVE, ForkServer

__all__ = ["RemoteForkServer", "remote_fork_server", "forking", "exit_code", "parse_exit", "close_all"]


class RemoteForkServer(ForkServer):
    """The fork server on the far end of ``ssh`` (the ssh command, its arguments and ``user@host``), run with the
    host's ``python``; a POSIX login shell reads the command."""

    def __init__(self, ssh: list[str], python: str):
        self.ssh = list(ssh)
        self.exits = f"/tmp/colab_kit-exits-{secrets.token_hex(8)}"  # made by the server, removed as it ends
        # a session that lives for the kernel: OpenSSH's keep-alives notice a connection a firewall dropped
        super().__init__([*_with_options(self.ssh, "ServerAliveInterval=15", "ServerAliveCountMax=3"),
                          shlex.join([python, "-c", SERVE, self.exits])], exits=self.exits)

    def abandon(self) -> None:
        """End the ssh session and the server at its far end (found by its unique directory of exit statuses: no
        request reaches a server that was not ready, so it has forked nothing of it)."""
        super().abandon()
        self._remote(f"pkill -f {shlex.quote(self.exits)} 2>/dev/null; true", 10)

    def _remote(self, script: str, timeout: float) -> str:
        """``script`` in the host's shell over a new ssh call (short connect timeout, no password prompt)."""
        try:
            return subprocess.run([*_with_options(self.ssh, "ConnectTimeout=5", "BatchMode=yes"), script],
                                  capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    def exit_script(self, pid: int, polls: int = 5) -> str:
        """Shell that prints ``__exit_code=N__`` once engine ``pid`` has ended and the server has written its
        status (polled every 0.1 s up to ``polls`` times), nothing while it runs or when nothing is known; it
        never ends the shell, so what follows it in the same call runs too."""
        path = shlex.quote(f"{self.exits}/{int(pid)}")
        return (f"i=0; while [ ! -f {path} ] && ! kill -0 {int(pid)} 2>/dev/null && [ $i -lt {polls} ]; do "
                f"i=$((i+1)); sleep 0.1 2>/dev/null || sleep 1; done; "
                f"if [ -f {path} ]; then echo __exit_code=$(cat {path})__; fi")

    def exit_code(self, pid: int, wait: float = 2.0) -> int | None:
        """How engine ``pid`` ended (``-9``: SIGKILL), read over ssh; None while it runs or when not known (a
        server no longer running wrote nothing more)."""
        if pid not in self.forked:
            return None
        return parse_exit(self._remote(self.exit_script(pid, max(1, int(10 * wait))), wait + 10))


def _with_options(ssh: list[str], *options: str) -> list[str]:
    """``ssh`` with ``-o`` options before its arguments, where it is OpenSSH's client (else as it is).

    >>> _with_options(["ssh", "-p", "2222", "me@b"], "BatchMode=yes"), _with_options(["sh", "-c"], "BatchMode=yes")
    (['ssh', '-o', 'BatchMode=yes', '-p', '2222', 'me@b'], ['sh', '-c'])
    """
    if not ssh or os.path.basename(ssh[0]) != "ssh":
        return list(ssh)
    return [ssh[0], *(x for o in options for x in ("-o", o)), *ssh[1:]]


def parse_exit(out: str) -> int | None:
    """The code in ``exit_script``'s output.

    >>> parse_exit("__process_running=0__\\n__exit_code=-9__\\n"), parse_exit("__process_running=0__\\n")
    (-9, None)
    """
    found = re.search(r"__exit_code=(-?\d+)__", out)
    return int(found.group(1)) if found else None


_SERVERS: dict[tuple, RemoteForkServer] = {}
_LOCK = threading.Lock()


def remote_fork_server(ssh: list[str], python: str) -> RemoteForkServer:
    """The kernel's fork server on the host ``ssh`` reaches, started on first use and kept for later clusters
    (its imports run on the host while the caller goes on; the first ``fork`` waits for them)."""
    key = (tuple(ssh), python)
    with _LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.alive:
            if server is not None:
                server.close()
            elif not _SERVERS:
                atexit.register(close_all)
            server = _SERVERS[key] = RemoteForkServer(ssh, python)
        return server


def forking(engine_cmd, remote_python: str) -> bool:
    """Whether an SSH engine with this command is forked: ipyparallel's own engine command, unless
    ``COLAB_KIT_FORK_ENGINES=0``."""
    return os.environ.get("COLAB_KIT_FORK_ENGINES", "1") != "0" and \
        list(engine_cmd) == [remote_python, "-m", "ipyparallel.engine"]


def exit_code(host: str, pid: int, wait: float = 2.0) -> int | None:
    """How engine ``pid`` on ``host`` (its hostname) ended, if a fork server of this kernel that still runs forked
    it (one that ended wrote nothing more: no ssh call is made for it)."""
    for server in list(_SERVERS.values()):
        if server.host == host and pid in server.forked and server.alive:
            return server.exit_code(pid, wait)
    return None


def close_all() -> None:
    """End every host's server (their engines run on)."""
    with _LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.close()

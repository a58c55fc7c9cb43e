"""A notebook session across two hosts, typed as a user types it, through a real IPython shell.

Run by ``tests/cluster/test_two_hosts.py`` inside host A's network namespace (the controller's host), with an sshd
on each host::

    python tests/scripts/ssh_cluster.py '{"addr_a": "10.231.7.1", "addr_b": "10.231.7.2", "profile": DIR}'

The profile's ``ipcluster_config.py`` holds what a user's ``~/.ssh/config`` would (the key, no host-key
prompt). Prints one JSON line at the end: what each step showed, for the test to check.
"""
import contextlib
import io
import json
import os
import sys
import time

import psutil
from IPython.testing.globalipapp import start_ipython

import colab_kit as ck

args = json.loads(sys.argv[1])
shell = start_ipython()
shell.run_line_magic("load_ext", "colab_kit")
seen: dict = {}

TRAIN = """%%colossal
import torch, colab_kit as ck
from colab_kit.models import GPT, GPTConfig
from colab_kit.datasets import SyntheticTokens
engine = ck.boost(GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)),
                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config, mesh=mesh)
data = SyntheticTokens(64, 16, seed=1)
losses = [engine.train_step(data.batch(s, 8)) for s in range(4)]
"""
KILL_ON_B = """%%colossal
import os, signal
for s in range(4, 8):
    if rank == 3 and s == 5:
        os.kill(os.getpid(), signal.SIGKILL)   # rank 3's engine, on host B, dies mid-run
    losses.append(engine.train_step(data.batch(s, 8)))
"""


def cell(src: str) -> tuple[str | None, str]:
    """(the error's text or None, everything the cell printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        result = shell.run_cell(src)
    error = result.error_in_exec or result.error_before_exec
    return (None if error is None else f"{type(error).__name__}: {error}"), out.getvalue()


def must(src: str) -> str:
    error, text = cell(src)
    if error is not None:
        print(json.dumps({"failed": src.splitlines()[0], "error": error, "output": text[-3000:], **seen}))
        sys.exit(1)
    return text


def listening() -> tuple[str, list[str]]:
    """On an engine: its host and the addresses its process listens on (gloo's pairs, rank 0's store)."""
    import os
    import socket

    import psutil

    addrs = [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN]
    return socket.gethostname(), addrs


def started_by() -> str:
    """On an engine: the command line of its parent (a host's fork server, or nothing left: ppid 1)."""
    import os

    import psutil

    try:
        return " ".join(psutil.Process(os.getppid()).cmdline())
    except psutil.Error:
        return ""


def losses() -> list[float]:
    from colab_kit.notebook.cluster.remote import namespace

    return namespace()["losses"]


state = ck.magics.state(shell)
t0 = time.monotonic()
seen["start_output"] = must(f"%colossal start --engines ssh --ip {args['addr_a']} "
                            f"--hosts {args['addr_a']}:2,{args['addr_b']}:2 --profile {args['profile']} --timeout 120")
seen["start_s"] = time.monotonic() - t0
cluster = state.cluster
seen["hosts"] = [row["host"] for row in cluster.ranks()]
seen["pids"] = [row["pid"] for row in cluster.ranks()]
seen["parents"] = cluster.run(started_by)
must("%colossal config dp=2 tp=2")
t0 = time.monotonic()
must(TRAIN)
seen["train_s"] = time.monotonic() - t0
seen["losses"] = cluster.run(losses)
seen["engines_listen"] = cluster.run(listening)
mine = psutil.Process().children(recursive=True)  # the controller and its schedulers, on host A
seen["controller_listen"] = sorted({c.laddr.ip for p in mine for c in p.net_connections(kind="inet")
                                    if c.status == psutil.CONN_LISTEN})

t0 = time.monotonic()
seen["kill_error"], seen["kill_output"] = cell(KILL_ON_B)
seen["kill_s"] = time.monotonic() - t0
seen["needs_restart"] = cluster.needs_restart

t0 = time.monotonic()
seen["restart_output"] = must("%colossal restart")
seen["restart_s"] = time.monotonic() - t0
seen["hosts_after"] = [row["host"] for row in cluster.ranks()]
seen["pids_after"] = [row["pid"] for row in cluster.ranks()]
seen["parents_after"] = cluster.run(started_by)
must(TRAIN)  # fresh engines, the config re-applied by the restart
seen["losses_after"] = cluster.run(losses)
t0 = time.monotonic()
must("%colossal stop")
seen["stop_s"] = time.monotonic() - t0
print(json.dumps(seen), flush=True)
os._exit(0)  # ipyparallel's launcher threads may still be winding down: the results are out

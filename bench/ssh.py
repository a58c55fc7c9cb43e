"""Engines over SSH: colab_kit's launcher against ipyparallel's own, side by side in one run.

    sudo python bench/ssh.py [--rounds 3]

Two hosts on this machine, for real (``tests/helpers/two_hosts.py``: network namespaces joined by a veth pair,
an sshd in each with its own hostname, one ssh connection per host shared through ``ControlMaster`` as a
user's ``~/.ssh/config`` would set it). In host A's namespace, ``ck.Cluster(engines=..., hosts={A: 2, B: 2})``
is started, restarted and stopped with

- colab_kit: ``engines="ssh"`` (``colab_kit/notebook/cluster/ssh.py``: every host's engines at once, a host's
  later engines on its first engine's ssh sender, waits and logs in the remote shell);
- ipyparallel: ``engines="ipyparallel.cluster.launcher.SSHEngineSetLauncher"``, its own launcher as its users
  run it, under the same ``Cluster`` (torch.distributed, the ranks table): only the launcher differs.

The sides alternate round by round so that machine load hits both alike. Each start is checked (4 ranks,
2 on each host, an all-reduce of the ranks' numbers gives 6) before it is timed further. Medians and
ratios (colab_kit / ipyparallel: below 1, colab_kit is faster) are printed and written to
bench/results/ssh.json. Needs root (namespaces); run by hand, not in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"colab_kit": "ssh", "ipyparallel": "ipyparallel.cluster.launcher.SSHEngineSetLauncher"}


def _sum_of_ranks():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return float(t)


def drive(args: dict) -> dict:
    """In host A's namespace: ``rounds`` of start, restart and stop for each side, alternating."""
    import colab_kit as ck
    from colab_kit.notebook.cluster import ssh_forked

    hosts = {args["addr_a"]: 2, args["addr_b"]: 2}
    seconds: dict = {side: {"start": [], "restart": [], "stop": []} for side in SIDES}
    for r in range(args["rounds"]):
        for side in (SIDES if r % 2 == 0 else list(SIDES)[::-1]):
            cluster = ck.Cluster(engines=SIDES[side], ip=args["addr_a"], hosts=hosts, profile_dir=args["profile"],
                                 timeout=120)
            t0 = time.monotonic()
            cluster.start(progress=False)
            seconds[side]["start"].append(time.monotonic() - t0)
            rows = cluster.ranks()
            assert [row["host"] for row in rows].count("ck-host-b") == 2, rows
            assert cluster.run(_sum_of_ranks, progress=False) == [6.0] * 4
            t0 = time.monotonic()
            cluster.restart(progress=False)
            seconds[side]["restart"].append(time.monotonic() - t0)
            assert cluster.run(_sum_of_ranks, progress=False) == [6.0] * 4
            t0 = time.monotonic()
            cluster.stop()
            seconds[side]["stop"].append(time.monotonic() - t0)
            ssh_forked.close_all()  # every start a kernel's first: the hosts' fork servers start with it
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--driver", help=argparse.SUPPRESS)  # the JSON arguments of the run in host A's namespace
    args = ap.parse_args(argv)
    if args.driver:
        print(json.dumps(drive(json.loads(args.driver))), flush=True)
        os._exit(0)  # ipyparallel's launcher threads may still be winding down: the results are out
    sys.path.insert(0, str(ROOT))
    from tests.helpers.two_hosts import namespaces, sshds

    try:
        from _results import row, write
    except ImportError:  # run as a module (python -m bench.ssh)
        from bench._results import row, write

    with namespaces() as h, tempfile.TemporaryDirectory() as d, sshds(h, Path(d)) as s:
        driver = json.dumps({"addr_a": s["addr_a"], "addr_b": s["addr_b"], "profile": s["profile"],
                             "rounds": args.rounds})
        run = subprocess.run(["ip", "netns", "exec", s["A"], sys.executable, __file__, "--driver", driver],
                             capture_output=True, text=True, timeout=1800, cwd=ROOT)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode != 0 or not lines:
        print(run.stdout[-3000:], run.stderr[-5000:], file=sys.stderr)
        return 1
    seconds = json.loads(lines[-1])
    rows, figures = [], {}
    for stage in ("start", "restart", "stop"):
        ours, theirs = (statistics.median(seconds[side][stage]) for side in SIDES)
        figures[stage] = {"colab_kit_s": round(ours, 2), "ipyparallel_s": round(theirs, 2),
                          "ratio": round(ours / theirs, 3),
                          "runs_s": {side: [round(x, 2) for x in seconds[side][stage]] for side in SIDES}}
        rows.append(row(f"{stage}: 4 engines on 2 hosts over ssh", f"colab_kit {ours:.2f} s",
                        f"ipyparallel's SSHEngineSetLauncher {theirs:.2f} s", ours / theirs,
                        note=f"medians of {args.rounds} alternating rounds"))
        print(f"{stage:8s} colab_kit {ours:6.2f} s   ipyparallel {theirs:6.2f} s   ratio {ours / theirs:.3f}")
    write("ssh", rows, figures=figures, args={"rounds": args.rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())

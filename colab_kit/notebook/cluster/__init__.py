"""The notebook's cluster: ipyparallel engines, one per rank, with torch.distributed up.

    core.py      Cluster: start / stop / restart, run and execute
    startup.py   waiting for engines, then torch.distributed on each (probe, store, init)
    gather.py    waiting for results: failures, deaths, timeouts, Ctrl-C, a dead controller
    watchdog.py  the engines and controller die with the kernel that started them
    remote.py    what runs inside each engine (probe, store, init, config, call)
    results.py   per-rank outputs, the ranks table, unwrapping ipyparallel results
"""
from .core import RESTART_ADVICE, Cluster, ClusterError
from .results import RankOutput, RankTable

__all__ = ["Cluster", "ClusterError", "RankOutput", "RankTable", "RESTART_ADVICE"]

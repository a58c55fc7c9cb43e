"""The notebook's cluster: ipyparallel engines, one per rank, with torch.distributed up.

    core.py      Cluster: start / stop / restart, run and execute with failure handling
    remote.py    what runs inside each engine (probe, store, init, config, call)
    results.py   per-rank outputs, the ranks table, unwrapping ipyparallel results
"""
from .core import RESTART_ADVICE, Cluster, ClusterError
from .results import RankOutput, RankTable

__all__ = ["Cluster", "ClusterError", "RankOutput", "RankTable", "RESTART_ADVICE"]

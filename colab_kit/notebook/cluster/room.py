"""How many engines the memory left on this host holds: ``Cluster(8, fit=True)``, ``%colossal start -n 8 --fit``.

A notebook on Binder gets 2 GiB for everything (the Jupyter server, the kernel, the controller and every
engine). Local engines are forked from one fork server that has imported torch and the engine's parts
(``forked.py``), so the pages of those imports are held once, by the server (312 MiB RSS), and each engine holds
what it adds of its own: 67 MiB once it has trained a small GPT, 136 MiB once it has imported transformers and
trained a Hugging Face GPT-2 as notebook 07 does (the engine with its ipyparallel nanny: psutil's USS, the pages
only that process holds, which is what a memory cgroup charges one more process); the controller and the
watchdog hold about 50 MiB together (``tests/cluster/test_cluster_room.py``, ``-s`` prints them;
``bench/cluster.py`` keeps the totals, 566 MiB PSS in all for 4 engines after three dp steps against 1,131 MiB
for engines started as their own interpreters, in bench/results/cluster.json).
Eight engines that trained a Hugging Face model need about 1.4 GiB with their server and controller, 2.0 GiB
with a Jupyter server and a kernel of 0.6 GiB: the OOM killer would end the kernel half way through a
notebook. ``fit=True`` asks for ``n`` and starts the largest of n, n/2, n/4, ... that the memory left holds, so a
config that divides ``n`` by powers of two (dp, tp, pp) still divides what starts; it says why when it starts
fewer.

The limit is the smallest of what this host declares:

* the memory cgroup this process is in (v2 ``memory.max`` less ``memory.current``; v1
  ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``): Binder's, Docker's, Kubernetes' limit;
* ``MEM_LIMIT`` (bytes), which JupyterHub's KubeSpawner sets in every Binder and JupyterHub session
  (what jupyter-resource-usage reads), less what this notebook server and its descendants hold (psutil's
  RSS of the kernel's parent and its tree: the server, its kernels, their clusters);
* the memory the operating system says is available (``psutil.virtual_memory().available``).

A worked example, Binder's 2 GiB with a server and a kernel that hold 0.6 GiB::

    >>> room = Room(free=int(1.4 * 2**30), source="MEM_LIMIT=2.00 GiB, 0.60 GiB in use")
    >>> n, why = fitting(8, room)
    >>> n
    4
    >>> print(why)  # doctest: +NORMALIZE_WHITESPACE
    memory left 1.40 GiB (MEM_LIMIT=2.00 GiB, 0.60 GiB in use) holds 6 engines of ~200 MiB beside a controller,
    not 8: starting 4 of the 8 asked for
    >>> fitting(4, room)[0]
    4
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

__all__ = ["ENGINE_BYTES", "CONTROLLER_BYTES", "FORK_SERVER_BYTES", "Room", "memory_room", "fitting"]

GiB, MiB = 2**30, 2**20
ENGINE_BYTES = 200 * MiB      # a forked engine and its nanny after a Hugging Face model's steps: 136 MiB USS, a margin
CONTROLLER_BYTES = 64 * MiB   # ipyparallel's controller (its hub and schedulers) and the watchdog: ~50 MiB USS
FORK_SERVER_BYTES = 344 * MiB  # the fork server, its imports done (312 MiB RSS): counted until it runs, then in use
_UNLIMITED = 2**60            # cgroup v1 writes "no limit" as a huge number


@dataclasses.dataclass(frozen=True)
class Room:
    """Bytes this host can still give new processes, and which limit said so."""
    free: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2, no limit) reads as None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> Room | None:
    """The memory cgroup's limit less its usage, v2 (unified) or v1, or None where there is no limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/user.slice/..." (v2) or "4:memory:/docker/..." (v1)
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":
            here = root / rel
            limit, used = _read_int(here / "memory.max"), _read_int(here / "memory.current")
            if limit is None and (root / "memory.max").exists() and rel:  # a container sees its own at the root
                here = root
                limit, used = _read_int(root / "memory.max"), _read_int(root / "memory.current")
            if limit is not None and used is not None:
                return Room(max(limit - used, 0), f"cgroup memory.max={limit / GiB:.2f} GiB, "
                                                  f"{used / GiB:.2f} GiB in use")
        elif "memory" in controllers.split(","):
            for here in (root / "memory" / rel, root / "memory"):
                limit = _read_int(here / "memory.limit_in_bytes")
                used = _read_int(here / "memory.usage_in_bytes")
                if limit is not None and used is not None and limit < _UNLIMITED:
                    return Room(max(limit - used, 0), f"cgroup memory.limit_in_bytes={limit / GiB:.2f} GiB, "
                                                      f"{used / GiB:.2f} GiB in use")
    return None


def _server_tree_rss() -> int:
    """RSS of this process's parent (the Jupyter server, under a kernel) and all its descendants."""
    import psutil

    me = psutil.Process()
    top = me.parent() or me
    total = 0
    for p in [top, *top.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # ended while we counted
            pass
    return total


def _mem_limit_room(env=os.environ) -> Room | None:
    text = env.get("MEM_LIMIT", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"MEM_LIMIT={text!r} is not a number of bytes: JupyterHub sets it as one "
                         "(2147483648 for 2 GiB); unset it or give bytes")
    limit, used = int(text), _server_tree_rss()
    return Room(max(limit - used, 0), f"MEM_LIMIT={limit / GiB:.2f} GiB, {used / GiB:.2f} GiB in use")


def memory_room(env=os.environ) -> Room:
    """The smallest of the cgroup's room, ``MEM_LIMIT``'s room and what the OS says is available."""
    import psutil

    rooms = [r for r in (_cgroup_room(), _mem_limit_room(env)) if r is not None]
    rooms.append(Room(psutil.virtual_memory().available, "available to new processes"))
    return min(rooms, key=lambda r: r.free)


def fitting(n: int, room: Room | None = None, per_engine: int = ENGINE_BYTES,
            beside: int = CONTROLLER_BYTES) -> tuple[int, str]:
    """The largest of n, n/2, n/4, ... engines that ``room`` holds beside a controller (``beside`` bytes: the
    controller and watchdog, and a fork server that is still to start), and a line saying why when that is
    fewer than n (empty when n fits). A room too small for one engine is refused."""
    room = room if room is not None else memory_room()
    holds = max((room.free - beside) // per_engine, 0)
    count = n
    while count > holds and count > 1:
        count //= 2
    if count > holds:
        raise MemoryError(f"memory left {room.free / GiB:.2f} GiB ({room.source}) does not hold one engine of "
                          f"~{per_engine // MiB} MiB beside a controller: stop other kernels or clusters, or use "
                          "ck.launch, whose ranks live only for the call")
    if count == n:
        return n, ""
    return count, (f"memory left {room.free / GiB:.2f} GiB ({room.source}) holds {holds} engines of "
                   f"~{per_engine // MiB} MiB beside a controller, not {n}: starting {count} of the {n} asked for")

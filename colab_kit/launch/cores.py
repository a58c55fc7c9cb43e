"""Where a local rank runs: its cores, its threads and how its allocator keeps memory (``ck.launch``'s ranks and
the notebook cluster's engines call ``place_rank`` and ``keep_freed_memory`` as they start).

Worked example, 4 ranks on a host of 2 cores (this machine): ``cores_for_rank`` puts ranks 0 and 2 on core 0 and
ranks 1 and 3 on core 1, so both ranks of a tp or sp pair (the fastest-varying axis) never share a core;
``place_rank`` binds each rank there with one torch thread, and ``ranks_share_cores()`` is then True in every rank
(``LOCAL_WORLD_SIZE`` 4 > 2 cores), which makes the engine fill one gradient bucket instead of two.
"""
from __future__ import annotations

import os

__all__ = ["threads_per_rank", "allowed_cores", "cores_for_rank", "HOST_CORES", "host_cores", "ranks_share_cores",
           "bind_rank", "place_rank", "keep_freed_memory"]


def threads_per_rank(ranks_on_host: int) -> int:
    """Cores per rank so that the ranks of one host do not oversubscribe it."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_host))


def allowed_cores() -> list[int]:
    """The cores this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit; all
    ``os.cpu_count()`` where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cores_for_rank(local_rank: int, local_world: int, cores: list[int] | None = None) -> list[int]:
    """The cores local rank ``local_rank`` of ``local_world`` ranks on this host is bound to: with at least
    as many cores as ranks, a block of ``len(cores) // local_world`` of its own; with fewer, one core, rank
    r on core ``r % len(cores)`` (``cores``: the ones this process may use, ``os.sched_getaffinity``).

    Worked example, 2 cores: 4 ranks -> rank 0 and 2 on core 0, ranks 1 and 3 on core 1 (so the pairs
    (0, 1), (2, 3) of a tp or sp group of 2, the fastest-varying axis, sit on different cores); 1 rank ->
    both cores::

        >>> [cores_for_rank(r, 4, [0, 1]) for r in range(4)], cores_for_rank(0, 1, [0, 1])
        ([[0], [1], [0], [1]], [0, 1])
    """
    if cores is None:
        cores = allowed_cores()
    if not 0 <= local_rank < max(1, local_world):
        raise ValueError(f"local rank {local_rank} of {local_world} ranks: give 0 <= local_rank < local_world")
    if not cores:
        return []
    if local_world >= len(cores):
        return [cores[local_rank % len(cores)]]
    per = len(cores) // max(1, local_world)
    return cores[local_rank * per:(local_rank + 1) * per]


HOST_CORES = "COLAB_KIT_HOST_CORES"
"""Environment variable a bound rank keeps the number of cores its host's ranks share in (``bind_rank`` sets it
before binding: afterwards ``os.sched_getaffinity`` shows the rank's own cores only)."""


def host_cores() -> int:
    """Cores this host's ranks may use: ``$COLAB_KIT_HOST_CORES`` where a launcher bound the rank, else the
    cores this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit), else
    ``os.cpu_count()``. The planner's constants record the same count (``planner.local.constants``, "cores")."""
    try:
        return max(1, int(os.environ[HOST_CORES]))
    except (KeyError, ValueError):
        return max(1, len(allowed_cores()))


def ranks_share_cores() -> bool:
    """Whether this host runs more ranks than it has cores: ``LOCAL_WORLD_SIZE`` (set by ``ck.launch``, the
    notebook cluster's engines and torchrun; 1 without one) above ``host_cores()``. The engine then fills one
    gradient bucket instead of two on CPU ranks (``zero.stage0.default_bucket_bytes``); the planner applies the
    same rule to its constants' cores and the config's world size (``planner.local.comm.shares_cores``: it prices
    one host)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return False
    return local > host_cores()


def bind_rank(local_rank: int, local_world: int, enabled: bool | None = None) -> list[int] | None:
    """Bind this process (and the threads it starts afterwards) to ``cores_for_rank``'s cores; the cores,
    or None where it is not done: an OS without ``sched_setaffinity`` (macOS), ``enabled=False``, or, with
    ``enabled`` None, ``COLAB_KIT_BIND=0`` in the environment (the OS then places the ranks, as before: for
    comparing). ``ck.launch`` passes the parent's reading of ``COLAB_KIT_BIND`` (its ranks fork from a server
    that may have started with another environment). Subprocesses a bound rank starts (DataLoader workers)
    inherit its cores.

    Why: with more ranks than cores the OS moves ranks between cores and, at times, puts the two ends of
    a collective on one core. On 4 ranks / 2 cores (gloo; ``python bench/bind.py``, one config per mode
    trained bound and OS-placed in alternating spawns) the bound steps took 0.72-0.93 of the time (ZeRO 3
    0.72, dp=4 0.86, dp=2 x tp=2 0.90, pp=4 0.93), and the cost of a collective in a step holds still between
    measurements (``planner.local.constants``, six measurements each way by hand: a 2-rank all-reduce 1.4-1.8 ms
    bound, 1.1-2.1 placed by the OS), so the planner's constants describe the runs they price.
    """
    if enabled is None:
        enabled = os.environ.get("COLAB_KIT_BIND", "1") != "0"
    if not enabled or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = allowed_cores()
    os.environ.setdefault(HOST_CORES, str(len(allowed)))
    cores = cores_for_rank(local_rank, local_world, allowed)
    try:  # every thread the process has (an ipyparallel engine's run before this call), then the caller's
        tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else []
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # a thread that ended meanwhile
                pass
        os.sched_setaffinity(0, cores)
    except OSError:
        return None
    return cores


def place_rank(local_rank: int, local_world: int, enabled: bool | None = None) -> int:
    """Bind this rank (``bind_rank``) and give torch a thread per core it is bound to (``threads_per_rank``
    where it is not bound); the threads. What ``ck.launch``'s ranks and the notebook cluster's engines do."""
    import torch
    threads = len(bind_rank(local_rank, local_world, enabled) or []) or threads_per_rank(local_world)
    torch.set_num_threads(threads)
    return threads


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(mmap_below: int = 32 << 20, trim_above: int = 256 << 20) -> bool:
    """Make a rank's C allocator keep the memory a step frees for the next step (glibc only).

    glibc serves blocks of 128 KiB and more (an activation of a small GPT) with ``mmap`` and
    hands them back on ``free``, and trims the heap's free top; the next step's tensors then
    fault their pages in again and the kernel zeroes them. A schedule that keeps more tensors
    alive between passes (a zero-bubble W holds its inputs and output gradients) hits this
    more: in one process, ZB-H1's order of a stage's F, I and W took 800-1,700 page faults
    per step and 1F1B's none, for the same work. So a rank serves blocks up to ``mmap_below``
    from its heap and returns the free top only beyond ``trim_above`` (PyTorch's CUDA caching
    allocator keeps device memory the same way). Returns whether the allocator took the settings
    (False on another libc, where nothing changes, and with ``COLAB_KIT_KEEP_FREED=0`` in the
    environment, which leaves glibc's own behaviour: for comparing, or for a host short of memory).
    """
    if os.environ.get("COLAB_KIT_KEEP_FREED", "1") == "0":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_below)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_above))
    except (OSError, AttributeError):
        return False

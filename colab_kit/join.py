"""``ck.init()``: join the process group a launcher started (torchrun, Slurm's srun, Open MPI, MPICH).

One call at the top of a script makes it run under any of them, as it runs in a notebook cluster::

    import colab_kit as ck
    ck.init()                                   # reads the launcher's environment, picks the device
    engine = ck.boost(model, opt, ck.ParallelConfig(dp=2, tp=2))
    ...

    $ torchrun --nproc-per-node 4 train.py                      # one host
    $ torchrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 4 train.py
    $ srun --ntasks 8 --ntasks-per-node 4 python train.py        # in an sbatch script
    $ mpirun -n 4 -x MASTER_ADDR=$(hostname) python train.py

What it reads (``detect``), first match wins:

    launcher   rank            world size        local rank              rendezvous address
    torchrun   RANK            WORLD_SIZE        LOCAL_RANK              MASTER_ADDR, MASTER_PORT
    Slurm      SLURM_PROCID    SLURM_NTASKS      SLURM_LOCALID           MASTER_ADDR, else the first host of
                                                                         SLURM_JOB_NODELIST; MASTER_PORT, else
                                                                         20000 + SLURM_JOB_ID % 20000
    Open MPI   OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK                MASTER_ADDR (loopback when every rank
    MPICH      PMI_RANK        PMI_SIZE          MPI_LOCALRANKID         is on this host), MASTER_PORT (29500)

Then the device: ``cuda:<local rank>`` with NCCL where this host has a GPU for every local rank, else the
CPU with gloo. For gloo, the interface: when every rank is on this host (the launcher says so:
``LOCAL_WORLD_SIZE == WORLD_SIZE``) or the address is loopback, gloo's sockets stay on loopback
(``colab_kit.net``'s rule); otherwise the interface whose address routes to the rendezvous address
(``interface_for``), so no ``GLOO_SOCKET_IFNAME`` needs setting by hand (one
the user set is kept). At the interpreter's exit the groups are destroyed while Python is still
whole (an ``atexit`` hook; no barrier, so a rank that leaves on an error never waits for its peers), and the
hook waits, the GIL free and at most 0.5 s, until gloo's worker threads have let go of their last collective
(``_leave``): left to the interpreter's teardown, a worker that asks for the GIL then aborts a rank that had finished
("terminate called without an active exception"). A missing or inconsistent variable is a ``ConfigError`` naming it; an
address that cannot be reached is a ``ConnectionError`` within ``timeout``, naming the address and where it came from.

Worked example, two hosts under torchrun (``--nnodes 2 --nproc-per-node 2 --master-addr 10.200.0.1``),
host B's interface ``veth-b`` holding 10.200.0.2::

    host A  rank 0  LOCAL_RANK 0  -> cpu, gloo on the interface holding 10.200.0.1 (it routes to itself)
    host A  rank 1  LOCAL_RANK 1  -> the same
    host B  rank 2  LOCAL_RANK 0  -> cpu, gloo on veth-b (10.200.0.2 routes to 10.200.0.1)
    host B  rank 3  LOCAL_RANK 1  -> the same
"""
from __future__ import annotations

import atexit
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

from .config import ConfigError
from .launch import nccl_device
from .net import interface_for, is_loopback, loopback_interface

__all__ = ["JobEnv", "detect", "init", "interface_for", "gloo_interface", "first_host"]


@dataclass(frozen=True)
class JobEnv:
    """What a launcher said about this process: ``launcher`` ("torchrun", "slurm", "openmpi", "mpich")."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int
    source: str  # where the address came from, for error messages ("MASTER_ADDR", "SLURM_JOB_NODELIST")

    @property
    def single_host(self) -> bool:
        return self.local_world_size == self.world_size


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"node[03-05,9],gpu1"`` -> ``"node03"``; each bracket of the
    first entry gives its first value (``"rack[1-2]-node[01-04]"`` -> ``"rack1-node01"``).

    >>> first_host("node[03-05,9],gpu1"), first_host("a1,a2")
    ('node03', 'a1')
    >>> first_host("gpu-[7]"), first_host("rack[1-2]-node[01-04]")
    ('gpu-7', 'rack1-node01')
    """
    text, depth, end = nodelist.strip(), 0, None
    for i, ch in enumerate(text):  # the first entry: up to the first comma outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    entry = text[:end]
    host = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], entry)
    if not host or "[" in host or "]" in host:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no host: set MASTER_ADDR to rank 0's host")
    return host


def _int(env, name: str, launcher: str) -> int:
    if name not in env:
        raise ConfigError(f"{launcher} sets {name}, and it is missing here: start the script with {launcher}, or "
                          f"set {name} yourself")
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} (from {launcher}) is not a whole number") from None


def detect(env=None) -> JobEnv | None:
    """The launcher's view of this process from ``env`` (default ``os.environ``); None when no launcher
    started it (a plain ``python train.py``: one rank)."""
    env = os.environ if env is None else env
    # the innermost launcher first: mpirun inside an sbatch job inherits the batch step's SLURM_PROCID
    keys: tuple[str, str, str, str | None]  # rank, world size, local rank, local world size (Slurm has none)
    if "RANK" in env or "WORLD_SIZE" in env or "LOCAL_RANK" in env:
        launcher, keys = "torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher, keys = "openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                     "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in env:
        launcher, keys = "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    elif "SLURM_PROCID" in env:
        launcher, keys = "slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)
    else:
        return None
    rank, world = _int(env, keys[0], launcher), _int(env, keys[1], launcher)
    local = _int(env, keys[2], launcher) if launcher != "torchrun" or keys[2] in env else rank
    local_world = int(env[keys[3]]) if keys[3] and keys[3] in env else None
    if launcher == "slurm" and "SLURM_NTASKS_PER_NODE" in env and env["SLURM_NTASKS_PER_NODE"].isdigit():
        local_world = int(env["SLURM_NTASKS_PER_NODE"])
    if not 0 <= rank < world:
        raise ConfigError(f"{keys[0]}={rank} is outside 0..{world - 1} ({keys[1]}={world}, from {launcher})")
    if local < 0 or local > rank:
        raise ConfigError(f"{keys[2]}={local} is inconsistent with {keys[0]}={rank} (a local rank is at most the "
                          f"global one), from {launcher}")
    if "MASTER_ADDR" in env:
        addr, source = env["MASTER_ADDR"], "MASTER_ADDR"
    elif launcher == "slurm" and "SLURM_JOB_NODELIST" in env:
        addr, source = first_host(env["SLURM_JOB_NODELIST"]), "SLURM_JOB_NODELIST"
    elif launcher in ("openmpi", "mpich") and local_world == world:
        addr, source = "127.0.0.1", "every rank on this host"
    else:
        raise ConfigError(f"MASTER_ADDR is not set: under {launcher} across hosts it must name rank 0's host "
                          f"(e.g. mpirun -x MASTER_ADDR=$(hostname))")
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT", launcher)
    elif launcher == "slurm" and "SLURM_JOB_ID" in env:
        port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
    elif launcher == "torchrun":
        raise ConfigError("MASTER_PORT is missing (torchrun sets it): start the script with torchrun, or set it")
    else:
        port = 29500
    return JobEnv(launcher, rank, world, local, local_world, addr, port, source)


def gloo_interface(job: JobEnv) -> str:
    """The interface gloo's sockets use for ``job``: loopback when every rank is on this host (or the address
    is loopback); else the one that routes to the rendezvous address. Where that route is loopback although
    ranks are on other hosts (a hostname that resolves to 127.0.1.1 here), the default route's interface, or
    a ``ConfigError`` asking for ``GLOO_SOCKET_IFNAME``."""
    if is_loopback(job.master_addr) or job.single_host:
        return loopback_interface()
    name = interface_for(job.master_addr)
    if name is not None and name == loopback_interface():
        name = interface_for("192.0.2.1")  # TEST-NET-1: only the default route's choice, nothing is sent
        name = None if name == loopback_interface() else name
    if name is None:
        raise ConfigError(f"cannot tell which network interface reaches the other hosts from {job.master_addr} "
                          f"(from {job.source}): set GLOO_SOCKET_IFNAME to it (e.g. eth0)")
    return name


def _reachable(addr: str, port: int, timeout: float) -> bool:
    import time
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, timeout)):
                return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.2)


def init(config=None, *, backend: str | None = None, timeout: float = 300.0) -> JobEnv | None:
    """Join the launcher's process group (see the module docstring); a no-op returning None where a
    process group exists already or no launcher started this process. ``config``: a ``ParallelConfig``
    whose world size must be the launcher's, checked before anything connects."""
    import torch
    import torch.distributed as dist

    job = detect()
    if config is not None:
        world = job.world_size if job is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        if config.world_size != world:
            where = f"WORLD_SIZE={world} from {job.launcher}" if job is not None else f"{world} rank(s)"
            raise ConfigError(f"the config is {config.describe()}, and this job has {where}: start "
                              f"{config.world_size} ranks (torchrun --nproc-per-node {config.world_size}), or pick "
                              f"degrees whose product is {world}")
    if dist.is_initialized() or job is None:
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # the same answer on every rank of a host; on CPU gloo (a real CPU job wants no checks) unless
    # COLAB_KIT_CPU_BACKEND says otherwise (the test suite asks for nccl_rules: NCCL's rules on gloo)
    backend = backend or ("nccl" if count else os.environ.get("COLAB_KIT_CPU_BACKEND", "gloo"))
    if backend == "nccl":
        per_rank = job.launcher != "torchrun" or (job.local_world_size or 1) == 1  # torchrun never binds GPUs
        if count == 1 and per_rank:  # one GPU visible to this rank (Slurm's --gpus-per-task=1, CUDA_VISIBLE_DEVICES)
            torch.cuda.set_device(0)
        elif job.local_rank < count and (job.local_world_size or 0) <= count:
            torch.cuda.set_device(job.local_rank)
        else:
            raise ConfigError(f"{job.local_world_size or job.local_rank + 1} ranks on this host and {count} GPUs: NCCL "
                              f"needs one GPU per rank; start one rank per GPU (torchrun --nproc-per-node {count})")
    elif "GLOO_SOCKET_IFNAME" not in os.environ:  # the user's choice stands
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface(job)
    os.environ.setdefault("MASTER_ADDR", job.master_addr)
    os.environ.setdefault("MASTER_PORT", str(job.master_port))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    if job.rank != 0 or agent:
        if not _reachable(job.master_addr, job.master_port, timeout):
            raise ConnectionError(f"rank {job.rank} could not reach the rendezvous at {job.master_addr}:"
                                  f"{job.master_port} (from {job.source}, {job.launcher}) within {timeout:g} s: check "
                                  f"that it is rank 0's host, reachable from this one, and the port open")
    wait = timedelta(seconds=timeout)
    if agent:  # one key space per restart: after --max-restarts a rank must never read a dead rank's address
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        base = dist.TCPStore(job.master_addr, job.master_port, job.world_size, is_master=False, timeout=wait)
        store = dist.PrefixStore(f"colab_kit/attempt_{attempt}", base)
        dist.init_process_group(backend, store=store, rank=job.rank, world_size=job.world_size, timeout=wait,
                                **nccl_device(backend))
    else:
        dist.init_process_group(backend, init_method="env://", rank=job.rank, world_size=job.world_size, timeout=wait,
                                **nccl_device(backend))
    atexit.register(_leave)
    return job


def _leave() -> None:
    """Destroy every process group this process still holds, then let gloo's worker threads finish
    (``init``'s exit hook; a no-op where the script destroyed them itself).

    Why the wait: a gloo worker thread marks a collective done and only then drops its own reference to the
    work, whose tensors are Python objects; that last decref needs the GIL. When the main thread's
    ``wait()`` returns and the script ends at once, the interpreter can be finalizing by the time the worker
    asks for the GIL, and a thread that asks for it then is ended by ``pthread_exit`` inside a C++ destructor:
    ``std::terminate``, "terminate called without an active exception", SIGABRT on a rank that had finished
    (seen under torchrun with a dp x tp mesh, about 1 run in 10 on 2 loaded cores; a core dump showed the
    worker in ``~AsyncAllreduceWork`` waiting for the GIL in ``Py_FinalizeEx``). Groups that nothing holds
    are freed by ``gc.collect()`` (their destructors join their threads without the GIL); groups a mesh or an
    engine still holds keep their threads, so the GIL is left free until no other thread of this process is
    running (``_settle``). What this does not cover: a collective still in flight at exit (async work nobody
    waited on) whose worker sleeps in the transport reads as idle and can still finish during the teardown;
    wait on what you launch."""
    import gc

    import torch.distributed as dist
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway: a peer already gone must not turn a finished run into a failure
        pass
    gc.collect()
    _settle()


def _settle(limit: float = 0.5, step: float = 0.005) -> float:
    """Sleep (the GIL free) until no thread of this process but the caller has been running at two looks in a
    row, ``step`` seconds apart, or ``limit`` seconds have passed; returns the seconds waited. Threads blocked
    on a lock, a condition or ``epoll`` are not running; one waiting for the CPU, or for the GIL this sleep
    frees, is. Where ``/proc`` is missing, one ``step``.

    >>> _settle() < 0.5       # nothing but this thread runs here
    True
    """
    import threading
    import time

    start, quiet, me = time.monotonic(), 0, threading.get_native_id()
    while quiet < 2 and time.monotonic() - start < limit:
        time.sleep(step)
        try:
            running = [t for t in os.listdir("/proc/self/task") if int(t) != me and _state(t) == "R"]
        except OSError:
            return time.monotonic() - start
        quiet = 0 if running else quiet + 1
    return time.monotonic() - start


def _state(tid: str) -> str:
    """The scheduler state of thread ``tid`` of this process (R running or runnable, S sleeping, ...)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"

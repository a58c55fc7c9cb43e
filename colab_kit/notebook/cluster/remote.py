"""What a ``ck.Cluster`` runs inside each ipyparallel engine (one engine = one rank).

The notebook kernel calls these functions on the engines through ipyparallel;
they are plain module functions so that every engine imports the same code.
Start-up is three rounds, all driven by ``Cluster.start``::

    probe()               every engine: {"host", "pid", "cuda", "ip"}     (who is where)
    open_store(...)       rank 0 only:  a TCPStore on a free port -> (addr, port)
    init_rank(...)        every engine: env vars, threads, device, init_process_group

Worked example, 4 local engines with ids 0..3 on host "box" (2 cores)::

    engine id  rank  LOCAL_RANK  threads  MASTER_ADDR:MASTER_PORT   backend
        0        0       0          1     127.0.0.1:41234            gloo
        1        1       1          1     127.0.0.1:41234            gloo
        2        2       2          1     ...
        3        3       3          1

After ``init_rank`` each engine's namespace (where ``%%colossal`` cells and
``cluster.execute`` code run) has ``rank`` (3 on engine 3), ``config`` (None
until a config is set) and ``mesh`` (a ``ck.ProcessMesh`` for ``config``, or None).
State that must outlive a call (the rendezvous store) lives in that namespace
under dunder names, never in a module global.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from datetime import timedelta

from ...errors.tracebacks import install as install_sources  # the kernel side is tracebacks.source_map
from ...errors.tracebacks import unpack
from ...comm import rules
from ...config import ParallelConfig
from ...launch import keep_freed_memory, nccl_device, place_rank
from ...mesh import ProcessMesh
from ...net import gloo_env, listening_store
from .ssh import SLOT

__all__ = ["probe", "open_store", "init_rank", "set_config", "call", "call_packed", "health", "namespace"]

_STORE = "__colab_kit_store__"


def namespace() -> dict:
    """The engine's user namespace (where executed cells run); a plain dict outside an engine."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:  # called outside an engine (a unit test calling the function directly)
        return sys.modules["__main__"].__dict__
    return shell.user_ns


def _route_ip(target: str) -> str:
    """The address of this host on the route to ``target`` (the controller): reachable by peers."""
    if target in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # UDP: no packet is sent, the OS only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def probe(controller_host: str, sys_path: list[str], cwd: str) -> dict:
    """Who and where this engine is. Also makes the kernel's import path visible here, so a
    function defined in a module next to the notebook (or a test file) can be sent to it."""
    import faulthandler
    import signal

    import torch

    # asked by SIGUSR1, this engine writes every thread's Python stack to its stderr, which ipyparallel relays as
    # the running call's output: a call that times out says where each rank is (gather.Waiting._where)
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True, chain=False)  # fd 2: captured by ipykernel
    missing = [p for p in sys_path if p not in sys.path and os.path.isdir(p or ".")]
    sys.path[:0] = missing
    if os.path.isdir(cwd) and os.path.abspath(os.getcwd()) != os.path.abspath(cwd) and cwd not in sys.path:
        sys.path.append(cwd)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"host": socket.gethostname(), "pid": os.getpid(), "ip": _route_ip(controller_host), "cuda": count,
            "gpus": [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)],
            "slot": os.environ.get(SLOT),  # an SSH engine's place in ``hosts`` order (ssh.SLOT)
            # whether ipykernel relays what is written to fd 2 (its watch of the fd; off where PYTEST_CURRENT_TEST
            # is set): where it does not, a stack dump reaches the engine's log, not the call's output
            "relays": bool(getattr(sys.stderr, "_should_watch", False))}


def open_store(addr: str, world_size: int, timeout: float) -> tuple[str, int]:
    """Rank 0: open the rendezvous store on ``addr`` only, on a free port (the OS picks it, so no
    race; ``colab_kit.net.listening_store`` keeps it off the other interfaces)."""
    store = listening_store(addr, world_size, timeout)
    namespace()[_STORE] = store
    return addr, store.port


def init_rank(rank: int, world_size: int, local_rank: int, local_world: int, addr: str, port: int,
              backend: str, timeout: float) -> dict:
    """Join the process group as ``rank`` and predefine ``rank``, ``config``, ``mesh``.

    ``local_rank`` is this engine's index among the engines of its host; with nccl it
    picks the GPU explicitly (ipyparallel gives every engine the same environment, so
    nothing else would tell two engines of one host apart).
    """
    import torch
    import torch.distributed as dist


    os.environ.update(gloo_env(addr))  # a loopback rendezvous keeps gloo's sockets on loopback too
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world))
    place_rank(local_rank, local_world)
    keep_freed_memory()
    device = "cpu"
    if backend == "nccl":  # its own GPU: the local_rank-th it sees, or the one it sees (--gpus-per-task=1)
        index = local_rank if torch.cuda.device_count() > 1 else 0
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    elif backend == "nccl_rules":
        rules.register()
    ns = namespace()
    store = ns.get(_STORE) if rank == 0 else None
    if store is None:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout),
                                **nccl_device(backend))
    ns.update(rank=rank, config=None, mesh=None)
    return {"device": device, "backend": backend, "threads": torch.get_num_threads()}


def set_config(config: dict | None) -> str:
    """Set ``config`` (a ParallelConfig) and build ``mesh`` (a ProcessMesh; a collective)."""
    ns = namespace()
    old = ns.get("mesh")
    if config is None:
        ns.update(config=None, mesh=None)
    else:  # the mesh boost() uses for this config too (ProcessMesh.shared): no second set of groups
        cfg = ParallelConfig.from_dict(config)
        ns.update(config=cfg, mesh=ProcessMesh.shared(cfg))
    if isinstance(old, ProcessMesh):
        old.release()
    if config is None:
        return "cleared"
    return cfg.describe()


def call(fn, args: tuple, kwargs: dict, sources: dict | None = None):
    """Run ``fn(*args, **kwargs)``; return ("ok", value) or ("error", traceback text).

    Catching here (rather than letting ipyparallel wrap the exception) keeps the
    traceback plain text and lets a result that cannot be pickled be reported too.
    ``sources`` (``source_map(fn, args)``, made in the kernel) puts the lines of code
    this engine cannot read, such as a notebook cell's, in its ``linecache`` first, so
    that the traceback quotes them.
    """
    try:
        install_sources(sources)
        return ("ok", fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt from an interrupt is a failure of this rank too
        return ("error", traceback.format_exc())


def call_packed(data: bytes, sources: dict | None = None):
    """``call`` for ``(fn, args)`` pickled in the kernel by ``tracebacks.pack``; unpickling failures are this
    rank's error too."""
    try:
        fn, args = unpack(data)
        fn = _in_namespace(fn)
    except BaseException:  # noqa: BLE001 - answered as this rank's error, as call() does
        return ("error", traceback.format_exc())
    return call(fn, args, {}, sources)


def _in_namespace(fn):
    """A function of the notebook (``__main__``) runs with this engine's namespace as its globals, as
    ipyparallel's own ``apply`` runs it: ``cluster.run(lambda: losses)`` reads the ``losses`` a
    ``%%colossal`` cell made on the rank. What the kernel sent along and the engine lacks (a model class
    the function names) is added to the namespace; what the engine has wins."""
    import types

    if not isinstance(fn, types.FunctionType) or fn.__module__ != "__main__":
        return fn
    ns = namespace()
    if fn.__globals__ is ns:
        return fn
    for name, value in fn.__globals__.items():
        if not name.startswith("__"):
            ns.setdefault(name, value)
    out = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__, out.__dict__, out.__qualname__ = fn.__kwdefaults__, dict(fn.__dict__), fn.__qualname__
    return out


def health(seconds: float) -> dict:
    """Where this rank's collectives stand, read without running one: every process group's sequence number
    (how many collectives this rank has issued on it) by group name, and what it issued under the rules and has
    not completed (``comm.rules.pending``). The kernel compares the ranks (``gather.out_of_step``): after an
    interrupt that stopped ranks at different collectives, a barrier would hang there, and this cannot."""
    import torch.distributed as dist

    seqs: dict[str, int] = {}
    if dist.is_initialized():
        world = dist.distributed_c10d._world
        for group, name in list(world.pg_names.items()):
            try:
                seqs[name] = int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
            except (RuntimeError, AttributeError):  # a backend without sequence numbers: nothing to compare
                pass
    return {"seq": seqs, "pending": rules.pending()}

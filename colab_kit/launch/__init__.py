"""``launch(fn, world_size, *args)``: run ``fn`` on local ranks with torch.distributed up.

Each rank is a fresh process (forked from a server that has already imported
torch, so a start costs a fraction of a second). The parent owns the rendezvous
store on a free port, so two launches never race for a port. On CPU the ranks
use gloo and split the cores between them: each rank is bound to its own cores (``bind_rank``) and
runs that many threads (``torch.set_num_threads``; both in ``launch.cores``); with ``backend="nccl"`` rank r
drives GPU r.

    >>> def hello(x):
    ...     import torch.distributed as dist
    ...     return dist.get_rank() * x
    >>> ck.launch(hello, 4, 10)
    [0, 10, 20, 30]

A rank that raises is reported with its rank and traceback (``RankError``), whose
lines are quoted even for code defined in a notebook cell (``tracebacks.pack``);
the ranks still waiting for it in a collective are stopped after a short
grace period instead of hanging the caller.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

from ..errors import stacks, tracebacks
from ..errors import RankError, RankTimeout
from ..net import LOOPBACK, gloo_env, listening_store
from .cores import (HOST_CORES, allowed_cores, bind_rank, cores_for_rank, host_cores, keep_freed_memory, place_rank,
                    ranks_share_cores, threads_per_rank)

try:
    import cloudpickle as _pickler  # results (the function and its arguments go through ``tracebacks.pack``)
except ImportError:  # pragma: no cover
    _pickler = pickle

__all__ = ["launch", "default_backend", "nccl_device", "threads_per_rank", "cores_for_rank", "bind_rank",
           "ranks_share_cores", "host_cores", "allowed_cores", "place_rank", "keep_freed_memory", "HOST_CORES"]

_CTX = None
_RELEASE = "colab_kit/launch/release"  # set by the parent once every rank has reported
_JOINED, _ALL_JOINED = "colab_kit/launch/joined", "colab_kit/launch/all_joined"  # ranks past init_process_group


# Hugging Face models colab_kit's policies know (colab_kit.policy.hf): importing them costs a rank about
# 3 s of CPU (measured on this 2-core machine: 4.5 s for torch + colab_kit + both, against 1.3 s without).
_HF_MODELS = ("transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama")


# What nearly every rank imports on its first boost: torch's optimizers import torch._dynamo when the
# first one is built (0.66 s a rank here), the placements DTensor (0.7 s), then the engine's own parts.
# Imported once in the forkserver, a rank forked from it starts with them (8 ranks on 2 cores: ~5 s a spawn).
# Also torch's distributed checkpoint, which a rank's first save or load imports (0.06 s of CPU a rank; 0.6% of
# tests/ranks' CPU, py-spy), for 0.06 s once in the server.
# The notebook cluster's fork server imports the same (``notebook/cluster/forked_server.py``'s WARM_MODULES).
ENGINE_MODULES = ("torch._dynamo", "torch.distributed.tensor", "colab_kit.engine.core", "colab_kit.placement",
                  "colab_kit.tensor.tp1d", "colab_kit.pipeline.executor", "colab_kit.zero.stage3",
                  "colab_kit.engine.checks", "torch.distributed.checkpoint")


RULES_ENV = ("COLAB_KIT_RULES_DEVICE", "COLAB_KIT_RULES_STAGE")
"""What a rank's ``nccl_rules`` groups read (``comm.rules``: the job's device, and staging through host copies),
handed from the caller's environment at each launch: the ranks fork from a server that started earlier."""


def preloaded() -> list[str]:
    """What the forkserver imports once, before it forks any rank: torch, colab_kit and the parts of both that
    a rank's first ``boost`` needs, always; the Hugging Face models too when this process has imported
    ``transformers`` by then (its user builds HF models, so every rank would import them); then the modules
    named in ``COLAB_KIT_PRELOAD`` (comma-separated), read at each launch. A module that fails to import is
    skipped by the forkserver.

    ``COLAB_KIT_PRELOAD`` is for what the module of a launched function imports: each rank unpickles the
    function by importing that module, and with it everything the module imports at its top. A test suite
    sets ``COLAB_KIT_PRELOAD=pytest`` (a test module imports pytest: 0.1 s of CPU in every rank of every
    launch here, 3% of the samples of a py-spy profile of tests/ranks); a script whose functions sit beside
    ``import sklearn`` names ``sklearn``. Worked example, a test file launched twice on 4 ranks::

        COLAB_KIT_PRELOAD unset     every launch: 4 ranks x import pytest (~0.1 s of CPU each)
        COLAB_KIT_PRELOAD=pytest    the server imports it once; its ranks start with it

    Naming a module after the first launch restarts the server at the next one (as importing
    ``transformers`` does)."""
    hf = list(_HF_MODELS) if "transformers" in sys.modules else []
    extra = [m.strip() for m in os.environ.get("COLAB_KIT_PRELOAD", "").split(",") if m.strip()]
    return ["torch", "torch.distributed", "colab_kit", *ENGINE_MODULES, *hf, *extra]


def _context():
    """The forkserver context, its server importing ``preloaded()``. When that list has grown since the
    server started (the caller imported ``transformers`` after its first launch: every rank would import
    the HF models itself, ~3 s each), the server is stopped between launches and restarts with it."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
    wanted = preloaded()
    server = getattr(_forkserver_module(), "_forkserver", None)
    running = getattr(server, "_preload_modules", None)
    if running != wanted:
        if running is not None and set(running) < set(wanted) and getattr(server, "_forkserver_pid", None) \
                and server is not None and hasattr(server, "_stop"):
            server._stop()  # no rank of ours is alive between launches; the next one starts it afresh
        _CTX.set_forkserver_preload(wanted)
    return _CTX


def _forkserver_module():
    import multiprocessing.forkserver
    return multiprocessing.forkserver


def default_backend(world_size: int) -> str:
    """'nccl' when every rank can have its own GPU, else 'nccl_rules': gloo under NCCL's rules
    (``colab_kit.comm.rules``), so that a program that runs on CPU ranks runs on GPUs too.
    Pass ``backend="gloo"`` for gloo's own, forgiving semantics."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return os.environ.get("COLAB_KIT_CPU_BACKEND", "nccl_rules")


def nccl_device(backend: str) -> dict:
    """``init_process_group``'s ``device_id`` for NCCL (this rank's current GPU), else nothing: with it NCCL makes
    its communicators at once instead of at the first collective, so a rank that cannot reach its peers fails at
    start-up, and torch can split groups from the world's communicator."""
    import torch

    if backend != "nccl":
        return {}
    return {"device_id": torch.device("cuda", torch.cuda.current_device())}


def _worker(rank, world_size, port, payload, results, backend, threads, timeout, bind=True, stacks_dir=None,
            rules_env=None):
    import torch
    import torch.distributed as dist

    status, value, store = "ok", None, None
    gc.freeze()  # what the fork server imported stays out of every collection (ProcessMesh.prune's included)
    try:
        if stacks_dir is not None:  # asked (SIGUSR1) where it is when launch gives up on it (errors.stacks)
            stacks.arm(os.path.join(stacks_dir, str(rank)))
        fn, args = tracebacks.unpack(payload)  # the caller's code keeps its file names and lines
        os.environ.update(gloo_env(LOOPBACK))  # gloo listens on loopback too
        os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        if threads is None:  # the default split: this rank's own cores, a thread each
            place_rank(rank, world_size, bind)
        else:
            torch.set_num_threads(threads)
        keep_freed_memory()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        os.environ.update(rules_env or {})  # the caller's, read at launch (comm.rules.staging)
        if backend == "nccl_rules" and os.environ.get("COLAB_KIT_RULES_DEVICE") == "cuda":  # ranks share the GPUs
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # nccl_rules is registered by importing colab_kit (its comm package), as this module's package is
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout),
                                **nccl_device(backend))
        # every rank's connections are up before any rank runs the caller's code: one that fails at
        # once (os._exit, a crash) then cannot break its peers' connecting, and is the only one blamed
        if store.add(_JOINED, 1) == world_size:
            store.set(_ALL_JOINED, "1")
        store.wait([_ALL_JOINED], timedelta(seconds=timeout))
        value = _pickler.dumps(fn(*args))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        status, value = "error", traceback.format_exc()
    results.put((rank, status, value))
    if status == "ok" and store is not None:
        # keep this rank's connections open until every rank has reported: a rank that
        # returns early and exits would break peers still connecting or finishing a collective
        try:
            store.wait([_RELEASE], timedelta(seconds=timeout + 60))  # the parent releases by its deadline
        except Exception:  # noqa: BLE001 - the parent is gone (its store closed): nothing left to wait for
            pass
    if status == "ok" and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def _main_not_reimported():
    """Start ranks without importing a main module that is no file again (``python - < script``,
    a pipe, an embedded interpreter): multiprocessing would try to, and every rank would die with
    FileNotFoundError. The ranks get ``fn`` by value (``tracebacks.pack``), so they need not."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def launch(fn, world_size: int, *args, backend: str | None = None, timeout: float = 600.0,
           grace: float = 5.0, threads: int | None = None) -> list:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return the results in rank order.

    ``timeout`` bounds the whole run; ``grace`` is how long the other ranks get
    to finish after one has failed before they are stopped. ``threads``: torch threads per rank; by
    default each rank is bound to its own cores (``bind_rank``) and runs a thread per core; given, the
    ranks are not bound and run that many threads each.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive whole number, got {world_size!r}")
    _check_launch(fn, world_size, backend, timeout, grace, threads)
    backend = backend or default_backend(world_size)
    try:
        payload = tracebacks.pack((fn, args))  # by value where needed, with the source lines of that code
    except Exception as exc:
        raise TypeError(f"launch could not pickle {getattr(fn, '__name__', fn)!r} and its arguments "
                        f"for the ranks: {exc}") from exc
    store = listening_store(LOOPBACK, world_size + 1, timeout)  # loopback only (colab_kit.net)
    ctx = _context()
    results = ctx.Queue()
    bind = os.environ.get("COLAB_KIT_BIND", "1") != "0"  # read here: the ranks fork from a server started earlier
    threads = threads or None  # 0: the default split, as before
    stacks_dir = tempfile.mkdtemp(prefix="colab_kit-stacks-")
    rules_env = {k: os.environ.get(k, "") for k in RULES_ENV}  # read here, as COLAB_KIT_BIND
    procs = [ctx.Process(target=_worker, args=(r, world_size, store.port, payload, results, backend, threads,
                                               timeout, bind, stacks_dir, rules_env), daemon=True)
             for r in range(world_size)]
    try:
        with _main_not_reimported():
            for p in procs:
                p.start()
    except BaseException:
        shutil.rmtree(stacks_dir, ignore_errors=True)
        raise
    reported: set[int] = set()
    try:
        return _collect(procs, results, timeout, grace, reported)
    except RankError as err:  # the ranks that never reported: where each one is, before they are stopped
        running = {r: p.pid for r, p in enumerate(procs) if r not in reported and p.is_alive() and p.pid}
        said = stacks.describe(stacks.where_ranks_are(running, stacks_dir))
        if said:
            err.advice = f"{err.advice}\n{said}" if err.advice else said
            err.args = (err._message(),)
        raise
    finally:
        shutil.rmtree(stacks_dir, ignore_errors=True)
        store.set(_RELEASE, "1")  # ranks that finished may exit now (and flush their output)
        for r, p in enumerate(procs):
            if r not in reported and p.is_alive():  # stuck in a collective or hanging
                p.kill()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store


BACKENDS = ("nccl_rules", "gloo", "nccl")
"""What ``launch(backend=)`` takes (None: ``default_backend``)."""


def seconds_refusal(name: str, value, zero_ok: bool = False) -> str | None:
    """Why ``value`` is no number of seconds for ``name`` (> 0, or >= 0 with ``zero_ok``), or None.

    >>> seconds_refusal("timeout", 0), seconds_refusal("grace", 0, zero_ok=True)
    ('timeout must be a number of seconds > 0, got 0', None)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0 \
            or (value == 0 and not zero_ok):  # value != value: NaN, which no comparison refuses
        return f"{name} must be a number of seconds {'>= 0' if zero_ok else '> 0'}, got {value!r}"
    return None


def _check_launch(fn, world_size: int, backend, timeout, grace, threads) -> None:
    """Refuse, before any rank starts, what every rank would fail at: each rule and a value that works.

    >>> try:
    ...     _check_launch(print, 2, "glooo", 60, 5, None)
    ... except ValueError as e:
    ...     print(str(e)[:52])
    backend='glooo' is not one launch runs: 'nccl_rules'
    """
    import torch

    if not callable(fn):
        raise TypeError(f"launch runs fn(*args) on every rank: fn must be callable, got {type(fn).__name__}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one launch runs: 'nccl_rules' (gloo under NCCL's rules, CPU "
                         "ranks' default), 'gloo', 'nccl' (one GPU a rank), or None for the default")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' gives each rank its own GPU: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs visible here; use backend=None (CPU ranks on "
                         "'nccl_rules') or fewer ranks")
    for name, value, zero in (("timeout", timeout, False), ("grace", grace, True)):  # grace 0: stop the rest at once
        why = seconds_refusal(name, value, zero_ok=zero)
        if why is not None:
            raise ValueError(why)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
        raise ValueError(f"threads must be a whole number of torch threads per rank (0 or None: the default "
                         f"split of this machine's cores), got {threads!r}")


def _collect(procs, results, timeout: float, grace: float, reported: set) -> list:
    """Gather every rank's message; ``reported`` collects the ranks that sent one."""
    world_size = len(procs)
    done: dict[int, object] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(done) + len(failures) < world_size:
        now = time.monotonic()
        if now > deadline:
            pending = [r for r in range(world_size) if r not in done and r not in failures]
            if failures:
                raise RankError(failures, pending, "launch", advice="  launch stopped those ranks' processes")
            raise RankTimeout(pending, timeout, "launch")
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue_mod.Empty:
            if any(p.exitcode is not None for r, p in enumerate(procs) if r not in done and r not in failures):
                time.sleep(0.2)  # a rank that exited may still have its message in the pipe
                if results.empty():
                    _record_silent_deaths(procs, done, failures, exitcode_zero=True)
            if failures:
                deadline = min(deadline, time.monotonic() + grace)
            continue
        reported.add(rank)
        if rank in failures:  # declared dead before its message was read: the message says more
            del failures[rank]
        if status == "ok":
            done[rank] = _pickler.loads(value)
        else:
            # a peer that died without a word (os._exit, segfault) is the likely cause of this
            # rank's error ("Connection closed by peer"), so it is recorded first; its exit can
            # show up a moment after that error, so the first error waits briefly for it
            _record_silent_deaths(procs, done, failures, exitcode_zero=False, wait=0.0 if failures else 0.25)
            failures.setdefault(rank, value)
            deadline = min(deadline, time.monotonic() + grace)
    if failures:
        raise RankError(failures, [], "launch")
    return [done[r] for r in range(world_size)]


_MAIN_HINT = ("; if ck.launch was called from a script, is the call under `if __name__ == \"__main__\":`? "
              "Each rank re-imports the script, so an unguarded call runs again in every rank")


def _record_silent_deaths(procs, done, failures, exitcode_zero: bool, wait: float = 0.0) -> None:
    """Record the ranks that exited without reporting (segfault, os._exit, OOM kill),
    polling up to ``wait`` seconds for one to appear.

    A rank exits with code 0 only after its message is in the pipe, so code 0 counts
    as silent only once the pipe is empty (``exitcode_zero``)."""
    until = time.monotonic() + wait
    while True:
        found = False
        for r, p in enumerate(procs):
            code = p.exitcode
            if r not in done and r not in failures and code is not None and (code != 0 or exitcode_zero):
                # code 1: Python failed before the rank's function could run (it reports everything else)
                failures[r] = (f"rank {r} exited with code {code} without reporting a result"
                               + (_MAIN_HINT if code == 1 else ""))
                found = True
        if found or time.monotonic() >= until:
            return
        time.sleep(0.01)


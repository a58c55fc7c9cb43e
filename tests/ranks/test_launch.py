"""Tier 2: ``ck.launch`` on real CPU processes with gloo.

Each launch of a few ranks costs a fraction of a second once the fork server is warm. The
failure tests check that the caller is told WHICH rank failed and why, and that it is not
left waiting for the ranks that were stuck in a collective with it.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import threading
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import colab_kit as ck
from colab_kit.errors import RankError, RankTimeout

# the package attribute ``ck.launch`` is the function; the module is reached through importlib
launch_mod = importlib.import_module("colab_kit.launch")

# rank functions travel by value: the ranks need not import this test module (nor pytest)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --------------------------------------------------------------------------- rank functions
def rank_info(x, y=None):
    return {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "args": (x, y), "threads": torch.get_num_threads(),
        "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def raise_on_2(kind):
    if dist.get_rank() == 2:
        raise ValueError("boom from rank 2")
    if kind == "barrier":
        dist.barrier()
    else:
        t = torch.ones(3)
        dist.all_reduce(t)
    return "finished"


def raise_on_0_while_1_sleeps():
    if dist.get_rank() == 0:
        raise RuntimeError("first failure")
    time.sleep(1000)


def hang_on_1():
    if dist.get_rank() == 1:
        time.sleep(1000)
    return dist.get_rank()


def exit_3_on_3(in_collective):
    if dist.get_rank() == 3:
        os._exit(3)
    if in_collective:
        t = torch.ones(2)
        dist.all_reduce(t)
    return dist.get_rank()


def sys_exit_on_1():
    if dist.get_rank() == 1:
        sys.exit(5)
    return "ok"


def unpicklable_result_on_1():
    return threading.Lock() if dist.get_rank() == 1 else "ok"


# --------------------------------------------------------------------------- results and arguments
def test_results_by_rank_and_args_passed():
    out = ck.launch(rank_info, 3, 5, {"k": [1, 2]})
    assert [o["rank"] for o in out] == [0, 1, 2]
    for r, o in enumerate(out):
        assert o["world"] == 3
        assert o["backend"] == "nccl_rules"  # gloo under NCCL's rules: ck.launch's default on CPU
        assert o["env"] == (str(r), "3", str(r))
        assert o["args"] == (5, {"k": [1, 2]})


def test_single_rank_and_tensor_results():
    assert ck.launch(lambda: torch.arange(3) * (dist.get_rank() + 1), 1)[0].tolist() == [0, 1, 2]


def test_closure_and_lambda():
    factor = 7

    def local(v):  # a closure over a local variable, defined in the test body
        return dist.get_rank() * factor + v

    assert ck.launch(local, 2, 1) == [1, 8]
    assert ck.launch(lambda a, b: (dist.get_rank(), a + b), 2, "x", "y") == [(0, "xy"), (1, "xy")]


def test_collectives_work_across_ranks():
    def fn():
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    assert ck.launch(fn, 4) == [10.0] * 4


def test_unpicklable_argument_is_refused_in_the_caller():
    with pytest.raises(TypeError, match="launch could not pickle 'rank_info'"):
        ck.launch(rank_info, 2, threading.Lock())


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2"])
def test_world_size_must_be_positive_int(bad):
    with pytest.raises(ValueError) as info:
        ck.launch(rank_info, bad)
    assert str(info.value) == f"world_size must be a positive whole number, got {bad!r}"


# --------------------------------------------------------------------------- threads
def test_threads_per_rank(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert launch_mod.threads_per_rank(4) == 4
    assert launch_mod.threads_per_rank(3) == 5
    assert launch_mod.threads_per_rank(1) == 16
    assert launch_mod.threads_per_rank(32) == 1
    assert launch_mod.threads_per_rank(0) == 16
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert launch_mod.threads_per_rank(4) == 1


def test_cores_for_rank():
    assert [launch_mod.cores_for_rank(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]
    assert [launch_mod.cores_for_rank(r, 3, list(range(16))) for r in range(3)] == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    assert launch_mod.cores_for_rank(0, 1, [2, 5]) == [2, 5]  # the cores the process may use, not 0..n
    assert launch_mod.cores_for_rank(5, 8, [3, 4, 6]) == [6]
    with pytest.raises(ValueError, match="local rank 4 of 4 ranks"):
        launch_mod.cores_for_rank(4, 4, [0, 1])


def test_ranks_share_cores(monkeypatch):
    """More local ranks than the host's cores (``$COLAB_KIT_HOST_CORES`` where a launcher bound the rank)."""
    monkeypatch.setenv("COLAB_KIT_HOST_CORES", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch_mod.host_cores() == 2 and launch_mod.ranks_share_cores()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not launch_mod.ranks_share_cores()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not launch_mod.ranks_share_cores()  # no launcher: one rank


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_ranks_bound_to_their_cores(monkeypatch):
    """Each rank runs on ``cores_for_rank``'s cores with a thread per core; ``threads=`` given or
    ``COLAB_KIT_BIND=0``: the OS places them (every core allowed)."""
    allowed = sorted(os.sched_getaffinity(0))
    got = ck.launch(rank_info, 4, 0)
    assert [o["cores"] for o in got] == [launch_mod.cores_for_rank(r, 4, allowed) for r in range(4)]
    assert [o["threads"] for o in got] == [len(o["cores"]) for o in got]
    if len(allowed) > 1:
        assert len({tuple(o["cores"]) for o in got}) > 1  # not all on one core
    assert all(o["cores"] == allowed for o in ck.launch(rank_info, 2, 0, threads=1))
    assert [o["cores"] for o in ck.launch(rank_info, 2, 0, threads=0)] == [  # 0: the default, as before
        launch_mod.cores_for_rank(r, 2, allowed) for r in range(2)]
    monkeypatch.setenv("COLAB_KIT_BIND", "0")
    assert all(o["cores"] == allowed for o in ck.launch(rank_info, 2, 0))


def test_threads_set_in_each_rank():
    assert [o["threads"] for o in ck.launch(rank_info, 2, 0, threads=2)] == [2, 2]
    default = launch_mod.threads_per_rank(2)
    assert [o["threads"] for o in ck.launch(rank_info, 2, 0)] == [default, default]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only expectation")
def test_default_backend_on_cpu(monkeypatch):
    assert launch_mod.default_backend(1) == "nccl_rules"
    assert launch_mod.default_backend(4) == "nccl_rules"
    monkeypatch.setenv("COLAB_KIT_CPU_BACKEND", "gloo")  # plain gloo, for a test about gloo (or a comparison)
    assert launch_mod.default_backend(4) == "gloo"


# --------------------------------------------------------------------------- failures
@pytest.mark.parametrize("kind", ["barrier", "all_reduce"])
def test_raising_rank_is_reported_while_others_wait_in_a_collective(kind):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        ck.launch(raise_on_2, 4, kind, timeout=120)
    elapsed = time.monotonic() - t0
    # the peers error out at once (gloo sees the closed connection) or are stopped after grace=5 s;
    # either way far sooner than the 120 s timeout (about 5 s here with the spawn: the bound is generous)
    assert elapsed < 60, f"launch took {elapsed:.1f} s: it waited for the stuck ranks"
    e = info.value
    assert type(e) is RankError
    assert e.rank == 2 and next(iter(e.failures)) == 2
    tb = e.failures[2]
    assert "Traceback (most recent call last)" in tb
    assert "in raise_on_2" in tb and 'raise ValueError("boom from rank 2")' in tb
    assert tb.rstrip().endswith("ValueError: boom from rank 2")
    assert set(e.failures) | set(e.stuck) == {0, 1, 2, 3}  # nobody got through the collective
    msg = str(e)
    assert msg.startswith("rank 2 failed in launch: ValueError: boom from rank 2")
    assert "--- traceback of rank 2 ---" in msg


def test_failed_rank_with_a_stuck_peer_stops_after_grace():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        ck.launch(raise_on_0_while_1_sleeps, 2, timeout=120, grace=1)
    assert time.monotonic() - t0 < 60  # after the grace, not the 120 s timeout (about 4 s with the spawn)
    e = info.value
    assert list(e.failures) == [0] and e.stuck == [1]
    assert "RuntimeError: first failure" in e.failures[0]
    assert "ranks 1 were still waiting" in str(e)
    assert "rank 1: test_launch.py:55 in raise_on_0_while_1_sleeps: time.sleep(1000)" in str(e), str(e)  # where
    assert not mp.active_children()  # the sleeping rank was stopped


def test_hanging_rank_gives_rank_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        ck.launch(hang_on_1, 3, timeout=3)
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 60  # the deadline starts after the spawn; the sleeping rank would take 1000 s
    e = info.value
    assert isinstance(e, RankError)
    assert e.stuck == [1] and e.failures == {} and e.timeout == 3
    assert e.rank == 1
    assert str(e).startswith("ranks 1 did not finish within 3 s in launch")
    assert "    rank 1: test_launch.py:60 in hang_on_1: time.sleep(1000)" in str(e), str(e)
    assert not mp.active_children()  # the hanging rank was stopped


def sleep_on_1_while_0_all_reduces():
    from datetime import timedelta
    patient = dist.new_group(timeout=timedelta(seconds=600))  # rank 0's all-reduce outwaits the launch's deadline
    if dist.get_rank() == 1:
        time.sleep(1000)
    dist.all_reduce(torch.ones(2), group=patient)


def test_the_rank_that_holds_up_a_collective_is_shown_where_it_is():
    """Rank 1 never enters the all-reduce rank 0 waits in: at the launch's deadline the error says where each
    running rank is, read from its Python stack (errors/stacks.py): rank 1 in its sleep, rank 0 in the
    all-reduce. The all-reduce's group waits longer than the deadline: with the launch's own timeout on both,
    they raced, and once rank 0 was caught building its own timeout's traceback (traceback.py)."""
    with pytest.raises(RankError) as info:
        ck.launch(sleep_on_1_while_0_all_reduces, 2, timeout=4)
    text = str(info.value)
    assert info.value.stuck == [0, 1], text
    assert "    rank 1: test_launch.py:248 in sleep_on_1_while_0_all_reduces: time.sleep(1000)" in text, text
    assert "    rank 0: test_launch.py:249 in sleep_on_1_while_0_all_reduces: dist.all_reduce" in text, text
    assert not mp.active_children()


def test_rank_that_exits_without_a_word_is_blamed_first():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        ck.launch(exit_3_on_3, 4, True, timeout=120)
    assert time.monotonic() - t0 < 60  # not the 120 s timeout
    e = info.value
    # the peers' "connection closed" errors come after it: rank 3 is the cause
    assert e.rank == 3 and next(iter(e.failures)) == 3
    assert e.failures[3] == "rank 3 exited with code 3 without reporting a result"
    assert str(e).startswith("rank 3 failed in launch: rank 3 exited with code 3 without reporting a result")


def test_rank_that_exits_while_others_finish():
    with pytest.raises(RankError) as info:
        ck.launch(exit_3_on_3, 4, False, timeout=60)
    assert info.value.failures == {3: "rank 3 exited with code 3 without reporting a result"}


def test_sys_exit_in_a_rank_is_reported():
    with pytest.raises(RankError) as info:
        ck.launch(sys_exit_on_1, 2, timeout=60)
    assert list(info.value.failures) == [1]
    assert info.value.failures[1].rstrip().endswith("SystemExit: 5")


def test_unpicklable_result_is_reported_for_that_rank():
    with pytest.raises(RankError) as info:
        ck.launch(unpicklable_result_on_1, 2, timeout=60)
    assert list(info.value.failures) == [1]
    assert "lock" in info.value.failures[1]


def test_launch_still_works_after_failures():
    assert ck.launch(lambda: dist.get_rank(), 4) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- error objects
def test_rank_error_message_and_fields():
    e = RankError({2: "Traceback ...\nValueError: x", 0: "Traceback ...\nRuntimeError: peer"}, [3, 1],
                  where="step", advice="check rank 2")
    assert e.rank == 2 and e.stuck == [1, 3]
    assert str(e).splitlines()[:4] == [
        "rank 2 failed in step: ValueError: x",
        "  rank 0 failed after it: RuntimeError: peer",
        "  ranks 1, 3 were still waiting (most likely in a collective for the failed rank)",
        "check rank 2",
    ]
    assert isinstance(e, RuntimeError)


def test_rank_timeout_message():
    e = RankTimeout([2, 0], 1.5, where="cluster.run")
    assert e.stuck == [0, 2] and e.rank == 0 and e.failures == {}
    assert str(e) == ("ranks 0, 2 did not finish within 1.5 s in cluster.run "
                      "(a collective that not every rank entered waits forever)")
    assert ck.RankTimeout is RankTimeout and ck.RankError is RankError


# --------------------------------------------------------------------------- finished ranks wait for the others
def early_finisher():
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set("pid0", str(os.getpid()))
        return "returned at once"
    time.sleep(1.0)  # rank 0 has long returned by now
    pid = int(store.get("pid0"))
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0]  # process state: R/S/D..., "Z" once it has exited


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_finished_rank_stays_connected_until_every_rank_reported():
    # a rank that returned early and exited would close its gloo connections under peers
    # that are still connecting (init) or finishing a collective with it
    out = ck.launch(early_finisher, 2, timeout=60)
    assert out[0] == "returned at once"
    assert out[1] in "RSD", f"rank 0 had exited (state {out[1]!r}) while rank 1 was still running"


def print_without_flush(folder):
    sys.stdout = open(os.path.join(folder, f"rank{dist.get_rank()}.txt"), "w")  # block-buffered
    print(f"hello from rank {dist.get_rank()}")  # no flush: only a normal exit writes it out
    return None


def test_finished_ranks_exit_normally_and_flush_their_output(tmp_path):
    ck.launch(print_without_flush, 2, str(tmp_path), timeout=60)
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text() == f"hello from rank {r}\n"


def test_an_unguarded_script_is_told_why_its_ranks_died(tmp_path):
    """Every rank re-imports the calling script; without a __main__ guard they die before running
    anything, and the error says what to change."""
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text("import colab_kit as ck\nprint(ck.launch(lambda: 1, 2))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "RankError" in done.stderr and 'under `if __name__ == "__main__":`' in done.stderr


def test_launch_from_a_script_piped_to_python():
    """``python - < script`` (a heredoc, a pipe): the main module is no file, so the ranks must not
    import it again; they get the function by value and run."""
    import subprocess

    code = "import colab_kit as ck\ndef f():\n    import torch.distributed as dist\n    return 10 * dist.get_rank()\n" \
           "print(ck.launch(f, 2), ck.launch(lambda: 7, 2))\n"
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 10] [7, 7]"


def _faults_per_round(rounds: int = 20) -> float:
    """Minor page faults per round of a step-like pattern: 8 blocks of 4 MiB made and freed while
    a 1 MiB tensor is kept (what a zero-bubble W does to an allocator: some tensors outlive the pass)."""
    import resource

    keep = []

    def one_round():
        blocks = [torch.ones(1 << 20) for _ in range(8)]
        keep.append(torch.ones(1 << 18))
        del blocks

    for _ in range(3):
        one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        one_round()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_ranks_keep_freed_memory_so_a_step_does_not_fault_its_pages_in_again():
    """A launched rank serves blocks below 32 MiB from its heap (``launch.keep_freed_memory``): the
    same pattern faults at least 4x fewer pages there than in a process with glibc's starting
    setting (blocks from 128 KiB up mapped on allocation and unmapped on free; glibc raises that
    bound itself only after it has freed a large mapped block, so a process's history decides).
    Measured: 8,457 against 0 per round."""
    import subprocess

    code = ("import ctypes, sys; ctypes.CDLL('libc.so.6').mallopt(-3, 128 * 1024); sys.path.insert(0, %r); "
            "import test_launch; print(test_launch._faults_per_round())" % os.path.dirname(__file__))
    plain = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 timeout=120).stdout.split()[-1])
    (launched,) = ck.launch(_faults_per_round, 1)
    assert plain > 4000, plain  # the pattern does fault under glibc's starting setting
    assert launched * 4 < plain, (launched, plain)


def _has_module(name: str) -> bool:
    import sys
    return name in sys.modules


def test_the_forkserver_restarts_when_what_it_preloads_grows(monkeypatch):
    """A module added to the preload list after the forkserver started (the caller imported transformers
    after its first launch) is in the next launch's ranks from the start, not imported by each of them."""
    assert ck.launch(_has_module, 1, "json.tool") == [False]  # the server runs, without it
    monkeypatch.setattr(launch_mod, "ENGINE_MODULES", launch_mod.ENGINE_MODULES + ("json.tool",))
    assert ck.launch(_has_module, 1, "json.tool") == [True]
    monkeypatch.undo()
    assert ck.launch(_has_module, 1, "json.tool") == [True]  # a shorter list keeps the running server


def test_colab_kit_preload_names_what_the_launched_functions_module_imports(monkeypatch):
    """``COLAB_KIT_PRELOAD`` adds modules to the forkserver's list, read at each launch: this suite names
    pytest there (tests/conftest.py), so no rank of any test file imports it while it unpickles its function
    (0.1 s of CPU a rank). This file's functions travel by value: a rank that has pytest got it from the
    server."""
    assert ck.launch(_has_module, 2, "pytest") == [True, True]
    assert ck.launch(_has_module, 1, "xml.dom.minidom") == [False]
    monkeypatch.setenv("COLAB_KIT_PRELOAD", os.environ.get("COLAB_KIT_PRELOAD", "") + ", xml.dom.minidom ,")
    assert launch_mod.preloaded()[-1] == "xml.dom.minidom"
    assert ck.launch(_has_module, 1, "xml.dom.minidom") == [True]

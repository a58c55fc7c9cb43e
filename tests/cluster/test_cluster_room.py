"""``fit=True`` (``%colossal start -n 8 --fit``): fewer engines where this host's memory would not hold n.

The limits are read the way Binder, Docker and JupyterHub declare them (a memory cgroup, v2 or v1;
``MEM_LIMIT``), here from files and variables the test writes, so nothing depends on this machine's
own limits. The browser tier runs the notebooks under Binder's ``MEM_LIMIT`` (2 GiB) for real.
"""
from __future__ import annotations

import os

import psutil
import pytest

from colab_kit.notebook.cluster import Cluster, ClusterError
from colab_kit.notebook.cluster import room
from colab_kit.notebook.cluster import forked
from colab_kit.notebook.cluster.room import CONTROLLER_BYTES, ENGINE_BYTES, FORK_SERVER_BYTES, Room, fitting

GiB, MiB = 2**30, 2**20


def test_fitting_halves_until_the_engines_fit():
    assert fitting(8, Room(64 * GiB, "plenty")) == (8, "")
    count, why = fitting(8, Room(int(1.4 * GiB), "MEM_LIMIT=2.00 GiB, 0.60 GiB in use"))
    assert count == 4
    assert "holds 6 engines" in why and "starting 4 of the 8 asked for" in why and "MEM_LIMIT=2.00 GiB" in why
    # exactly enough for n, and one byte less
    assert fitting(8, Room(CONTROLLER_BYTES + 8 * ENGINE_BYTES, "x"))[0] == 8
    assert fitting(8, Room(CONTROLLER_BYTES + 8 * ENGINE_BYTES - 1, "x"))[0] == 4
    assert fitting(6, Room(CONTROLLER_BYTES + 5 * ENGINE_BYTES, "x"))[0] == 3   # halves: 6 -> 3, never 5
    assert fitting(8, Room(CONTROLLER_BYTES + ENGINE_BYTES, "x"))[0] == 1
    with pytest.raises(MemoryError, match="does not hold one engine"):
        fitting(8, Room(CONTROLLER_BYTES + ENGINE_BYTES - 1, "x"))


def _cgroup(tmp_path, line: str, files: dict[str, str]):
    (tmp_path / "proc").mkdir(parents=True)
    (tmp_path / "proc" / "cgroup").write_text(line + "\n")
    for rel, text in files.items():
        path = tmp_path / "sys" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return dict(root=tmp_path / "sys", proc_cgroup=tmp_path / "proc" / "cgroup")


def test_cgroup_v2_and_v1_limits_are_read(tmp_path):
    v2 = _cgroup(tmp_path / "a", "0::/user.slice/jupyter", {"user.slice/jupyter/memory.max": str(2 * GiB),
                                                            "user.slice/jupyter/memory.current": str(GiB // 2)})
    got = room._cgroup_room(**v2)
    assert got.free == 2 * GiB - GiB // 2 and "memory.max=2.00 GiB" in got.source
    unlimited = _cgroup(tmp_path / "b", "0::/", {"memory.max": "max", "memory.current": "12345"})
    assert room._cgroup_room(**unlimited) is None
    in_container = _cgroup(tmp_path / "c", "0::/kubepods/pod1", {"memory.max": str(GiB), "memory.current": str(GiB // 4)})
    assert room._cgroup_room(**in_container).free == GiB - GiB // 4   # a container sees its own at the root
    v1 = _cgroup(tmp_path / "d", "5:cpuacct,cpu:/x\n4:memory:/docker/abc",
                 {"memory/docker/abc/memory.limit_in_bytes": str(3 * GiB),
                  "memory/docker/abc/memory.usage_in_bytes": str(GiB)})
    assert room._cgroup_room(**v1).free == 2 * GiB
    v1_free = _cgroup(tmp_path / "e", "4:memory:/", {"memory/memory.limit_in_bytes": str(2**63 - 4096),
                                                     "memory/memory.usage_in_bytes": str(GiB)})
    assert room._cgroup_room(**v1_free) is None


def test_mem_limit_counts_the_server_tree():
    me = psutil.Process()
    got = room._mem_limit_room({"MEM_LIMIT": str(64 * GiB)})
    used = 64 * GiB - got.free
    assert used >= me.memory_info().rss     # this process is in its parent's tree
    assert "MEM_LIMIT=64.00 GiB" in got.source
    assert room._mem_limit_room({}) is None
    with pytest.raises(ValueError, match="MEM_LIMIT='2G' is not a number of bytes"):
        room._mem_limit_room({"MEM_LIMIT": "2G"})


def test_the_smallest_room_wins():
    tight = room.memory_room({"MEM_LIMIT": str(2 * GiB)})
    assert tight.source.startswith("MEM_LIMIT=2.00 GiB") or tight.free <= 2 * GiB
    assert room.memory_room({}).free >= tight.free


def test_cluster_fit_picks_fewer_engines_before_starting_any(monkeypatch):
    server = 0 if forked.server_pid() else FORK_SERVER_BYTES  # the fork server is counted until it runs
    monkeypatch.setenv("MEM_LIMIT", str(room._server_tree_rss() + CONTROLLER_BYTES + server + 5 * ENGINE_BYTES))
    cluster = Cluster(8, fit=True)
    assert cluster.n == 4 and "starting 4 of the 8 asked for" in cluster.fit_note and not cluster.running
    assert Cluster(8).n == 8 and Cluster(8).fit_note == ""         # without fit, n is n
    monkeypatch.setenv("MEM_LIMIT", str(room._server_tree_rss() + 64 * MiB))
    with pytest.raises(ClusterError, match="does not hold one engine"):
        Cluster(8, fit=True)
    monkeypatch.setenv("MEM_LIMIT", "lots")
    with pytest.raises(ClusterError, match="not a number of bytes"):
        Cluster(8, fit=True)
    monkeypatch.delenv("MEM_LIMIT")
    with pytest.raises(ClusterError, match="fit=True counts this host's memory"):
        Cluster(8, engines="ssh", ip="127.0.0.1", hosts={"127.0.0.1": 8}, fit=True)
    assert os.environ.get("MEM_LIMIT") is None


def test_what_an_engine_and_the_controller_hold_is_within_the_constants():
    """The figures ``fitting`` counts with, measured: a fresh 2-engine cluster trains three dp steps of a Hugging
    Face GPT-2 (transformers imported on the engines, as notebook 07 does: the most an engine of the notebooks
    holds; a small colab_kit GPT leaves 67 MiB); each engine with its nanny holds at most ``ENGINE_BYTES`` of pages
    of its own (psutil's USS, what a memory cgroup charges one more process) and not less than half of it (the
    constant is not a guess ten times too high); the controller's processes and the watchdog together at most
    ``CONTROLLER_BYTES``; the fork server the engines were forked from, whose pages they share, at most
    ``FORK_SERVER_BYTES`` (its RSS)."""
    def train():
        import torch
        import transformers
        import colab_kit as ck
        from colab_kit.datasets import SyntheticTokens
        cfg = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=32, vocab_size=256,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        torch.manual_seed(0)
        engine = ck.boost(transformers.GPT2LMHeadModel(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          ck.ParallelConfig(dp=2))
        for step in range(3):
            engine.train_step(SyntheticTokens(256, 32).batch(step, 8))
        engine.close()

    def uss(p) -> int:
        try:
            return p.memory_full_info().uss
        except psutil.Error:
            return 0

    with Cluster(2) as cluster:
        cluster.run(train)
        ranks = [psutil.Process(row["pid"]) for row in cluster.ranks()]
        nannies = [c for r in ranks for c in r.children()]  # each engine's one child (forked by it)
        assert len(ranks) == len(nannies) == 2 and set(nannies) <= set(cluster._engine_procs), (ranks, nannies)
        per_engine = [sum(uss(p) for p in group) for group in (ranks, nannies)]
        controller = sum(uss(p) for p in cluster._controller_procs) + uss(psutil.Process(cluster._watchdog.pid))
        assert forked.server_pid() is not None, "local engines are forked from the kernel's fork server"
        server_rss = psutil.Process(forked.server_pid()).memory_info().rss  # the imports its engines share
    engine_and_nanny = per_engine[0] / 2 + per_engine[1] / 2
    print(f"engine + nanny {engine_and_nanny / MiB:.0f} MiB, controller + watchdog {controller / MiB:.0f} MiB, "
          f"fork server {server_rss / MiB:.0f} MiB")  # -s
    assert ENGINE_BYTES / 2 <= engine_and_nanny <= ENGINE_BYTES, engine_and_nanny / MiB
    assert 0 < controller <= CONTROLLER_BYTES, controller / MiB
    assert 0 < server_rss <= FORK_SERVER_BYTES, server_rss / MiB

"""The checkpoint's map at 70B scale, on paper: one rank of 64 built as ``ck.dry_run`` builds it, no values.

A GPT shaped like Llama 3 70B (d_model 8192, 80 layers, vocab 128256: 66.6B parameters) under
``ParallelConfig(dp=8, tp=8, zero=3)``: ranks 0 and 63 of the 64 are built in a fresh process as ranks of
torch's ``fake`` process group (``colab_kit.planner.dry_runs.run``'s recipe: a meta model, storage without
values, ``_unwritten``; here the copies of each piece's values are skipped too: written, the rank's 4 GB
of ZeRO-3 pieces took 17 s and 4.9 GB resident, against 4 s and 350 MB), and ``layout.local_space(engine)``
is the map a save or a load would build there.

Measured: rank 0 holds 1,044,226,048 elements in 325 tiles, 20,800 bytes (``LocalSpace.nbytes()``);
rank 63 243 tiles, 15,552 bytes; the same at d_model 4096 (270,454,784 elements). The per-element map
the checkpoint held before (a dense and a local int32 per element) was 8,353,808,384 bytes on rank 0.
The bound asserted (64 bytes x 9 tiles per dense tensor, 555,840 bytes for its 965 tensors) fails that
map by four orders of magnitude. About 6 s for the four builds. Zero=1 is not built here: its one flat bucket per rank is a single
33.5 GB allocation, more than this machine lets a process reserve.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
D_MODELS, RANKS = (4096, 8192), (0, 63)


def _build(jobs: list) -> list:
    """In the fresh process: each ``(d_model, rank)``'s map sizes, built under the fake process group."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    import colab_kit as ck
    from colab_kit.checkpoint.layout import local_space
    from colab_kit.models import GPT, GPTConfig
    from colab_kit.planner.dry_runs.child import BIG, _no_values, _unwritten
    from colab_kit.sharded_init import meta_twin

    class NoClones(TorchDispatchMode):
        """A shard's values copied out of its (unset) dense recipe: storage only, as ``_unwritten``'s fills."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default and args[0].numel() >= BIG:
                return torch.empty(args[0].shape, dtype=args[0].dtype, device=args[0].device)
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    out = []
    for d_model, rank in jobs:
        cfg = GPTConfig(vocab_size=128256, seq_len=4096, d_model=d_model, n_heads=64, n_layers=80)
        model = meta_twin(GPT(cfg, device="meta"))
        model.init_parameter = _no_values
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
        try:
            with _unwritten(), NoClones():
                engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps), ck.ParallelConfig(dp=8, tp=8, zero=3))
            space = local_space(engine)
            out.append(dict(d_model=d_model, rank=rank, nbytes=space.nbytes(), numel=space.numel(),
                            tiles=sum(len(space.tiles(n)) for n in space.table.names),
                            tensors=len(space.table.names), params=space.table.total))
            engine.close()
        finally:
            dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def maps():
    jobs = [(d, r) for d in D_MODELS for r in RANKS]
    code = ("import json, sys; from tests.ranks.test_checkpoint_scale import _build; "
            "print(json.dumps(_build(json.loads(sys.argv[1]))))")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {(m["d_model"], m["rank"]): m for m in got}


def test_a_70b_rank_map_is_kilobytes_and_the_per_element_one_gigabytes(maps):
    for (d_model, rank), m in maps.items():
        bound = 64 * 9 * m["tensors"]  # 8 ints per tile, at most 3 ZeRO row pieces x 3 fused parts per tensor
        assert m["nbytes"] <= bound < 1 << 20, m
        assert m["nbytes"] == 64 * m["tiles"]
        old = 8 * m["numel"]  # a dense and a local int32 per element: what the checkpoint built before
        assert old > 1000 * bound, m  # the bound fails the per-element map
        assert m["numel"] * 64 == pytest.approx(m["params"], rel=0.01)  # zero=3: a 64th of the model
    big = maps[8192, 0]
    assert 66e9 < big["params"] < 67e9 and 8e9 < 8 * big["numel"] < 9e9  # the ~8.4 GB the maps took per rank


def test_the_map_does_not_grow_with_d_model(maps):
    for rank in RANKS:
        small, big = maps[4096, rank], maps[8192, rank]
        assert big["numel"] > 3.5 * small["numel"]  # about four times the elements ...
        assert big["nbytes"] == small["nbytes"]  # ... the same tiles

"""Sharded initialisation (``colab_kit.sharded_init``): a GPT built on the meta device, boosted, holds
exactly the shards of the dense GPT boosted the same way, trains to the same losses, and no
rank ever holds much more than its own shards plus one whole parameter.

Memory is measured, not estimated: ``LiveBytes`` counts the storage bytes of every tensor the
ops create while it is on, each storage once, until that storage is freed. Each spawn loops
over its configurations inside the ranks; the plans' cuts on every rank of an 8-rank mesh
are checked in this process, from each rank's coordinates.
"""
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.sharded_init import defer, materialize
from colab_kit.models import GPT, GPTConfig

from tests.helpers import BIG, LiveBytes, dense_sizes as _sizes

SGD = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)  # noqa: E731
TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=1)  # colab_kit.sharded_init's example
PARITY = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
STEPS, BATCH = 2, 8


@contextmanager
def mark_before_grad_buckets(tracker: LiveBytes):
    """The data-parallel step of parallelize allocates the gradient buckets (engine.memory()['grads']) once the
    parameters are made: keep the tracker's peak at that moment as 'params made'."""
    import colab_kit.zero.apply as engine_module

    real = engine_module.DataParallel

    def marked(*args, **kwargs):
        tracker.mark("params made")
        return real(*args, **kwargs)

    engine_module.DataParallel = marked
    try:
        yield
    finally:
        engine_module.DataParallel = real


# --------------------------------------------------------------------------- one process
def test_each_parameter_is_made_alone_in_any_order():
    dense = GPT(TINY)
    meta = GPT(TINY, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    for name, p in reversed(list(dense.named_parameters())):  # the reverse of the dense order
        assert torch.equal(meta.init_parameter(name, torch.empty(p.shape)), p), name
    with torch.device("meta"):  # the context-manager form builds the same meta model
        assert all(p.is_meta for p in GPT(TINY).parameters())
    state = torch.get_rng_state()
    GPT(TINY)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left as it was


def test_materialize_makes_the_dense_values_and_refuses_what_has_no_recipe():
    meta = GPT(TINY, device="meta")
    with pytest.raises(ValueError, match=r"tok.weight is on the meta device and has no recipe"):
        materialize(GPT(TINY, device="meta"))  # defer() never ran
    assert defer(meta) and not defer(GPT(TINY))  # a dense model: nothing to do
    materialize(meta)
    for (name, p), q in zip(meta.named_parameters(), GPT(TINY).parameters()):
        assert isinstance(p, nn.Parameter) and p.requires_grad and torch.equal(p, q), name
    with torch.device("meta"):
        plain = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"Linear was built on the meta device but has no init_parameter"):
        defer(plain)


# --------------------------------------------------------------------------- parity
PARITY_CFGS = [dict(dp=2, tp=2), dict(tp=4, tp_mode="2d"), dict(tp=4, tp_mode="2.5d", tp_depth=1),
               dict(pp=2, dp=2, microbatches=2), dict(pp=2, tp=2, microbatches=2)]


def _parity(cfgs):
    """Per config: (shard names, all shards bit-equal, losses from meta, losses from dense)."""
    data, out = SyntheticTokens(PARITY.vocab_size, PARITY.seq_len, seed=1), {}
    for kw in cfgs:
        cfg = ck.ParallelConfig(**kw)
        engines = [ck.boost(GPT(PARITY, device="meta"), SGD, cfg), ck.boost(GPT(PARITY), SGD, cfg)]
        got, want = (dict(e.module.named_parameters()) for e in engines)
        same = got.keys() == want.keys() and all(
            torch.equal(got[n], want[n]) and not got[n].is_meta and got[n].requires_grad
            and engines[0].placement_table[got[n]] == engines[1].placement_table[want[n]]
            for n in want)
        losses = [[e.train_step(data.batch(s, BATCH)) for s in range(STEPS)] for e in engines]
        out[tuple(sorted(kw.items()))] = sorted(got), same, *losses
        for e in engines:
            e.close()
    return out


def _check_parity(results, n_cfgs):
    for rank, res in enumerate(results):
        assert len(res) == n_cfgs
        for cfg, (names, same, from_meta, from_dense) in res.items():
            assert names and same, (rank, cfg)
            assert from_meta == from_dense, (rank, cfg)  # the same shards: the same losses, bit for bit
            assert from_meta[0] != from_meta[-1], (rank, cfg)  # it trained


def test_meta_model_boosts_to_the_dense_shards_and_losses():
    _check_parity(ck.launch(_parity, 4, PARITY_CFGS), len(PARITY_CFGS))


class LayoutMesh:
    """One rank's sizes and coordinates from the pure ``MeshLayout``: all a plan's ``parallelize``
    reads (it cuts shards without communicating), so every rank of an 8-rank cube is checked in
    this process, without spawning 8 ranks on 2 cores."""

    def __init__(self, config, rank: int):
        self.config, self.layout = config, ck.MeshLayout(config)
        self.coords = self.layout.all_coords(rank)

    def size(self, axis: str) -> int:
        return self.layout.size(axis)

    def rank(self, axis: str) -> int:
        return self.coords[axis]


@pytest.mark.parametrize("kw", [dict(tp=4), dict(tp=8, tp_mode="2.5d", tp_depth=2), dict(tp=8, tp_mode="3d")])
def test_every_rank_of_a_plan_cuts_the_dense_shards_from_a_meta_model(kw):
    from colab_kit.tensor import plan_for

    cfg = ck.ParallelConfig(**kw)
    for rank in range(cfg.world_size):
        plan = plan_for(LayoutMesh(cfg, rank))
        meta = GPT(PARITY, device="meta")
        defer(meta)
        got = dict(materialize(plan.parallelize(meta)).named_parameters())
        want = dict(plan.parallelize(GPT(PARITY)).named_parameters())
        assert got.keys() == want.keys(), (kw, rank)
        for name, p in want.items():
            assert torch.equal(got[name], p), (kw, rank, name)


# --------------------------------------------------------------------------- memory
MEMORY_CASES = [("example", TINY, dict(dp=2, tp=2)), ("1d", BIG, dict(tp=4)),
                ("pp+tp", BIG, dict(pp=2, tp=2, microbatches=2))]


def _peaks(cases):
    """Per case, on this rank: live-byte peaks of making the parameters (until the gradient
    buckets), of the whole boost, and of building the dense GPT and boosting it; and what
    the engine holds."""
    out = {}
    for name, model_cfg, kw in cases:
        cfg = ck.ParallelConfig(**kw)
        mesh = ck.ProcessMesh(cfg)
        with LiveBytes() as meta, mark_before_grad_buckets(meta):
            engine = ck.boost(GPT(model_cfg, device="meta"), SGD, cfg, mesh=mesh)
        held = engine.memory()
        with LiveBytes() as dense:
            ck.boost(GPT(model_cfg), SGD, cfg, mesh=mesh).close()
        out[name] = dict(made=meta.marks["params made"], boost=meta.peak, dense=dense.peak,
                         params=held["params"], grads=held["grads"])
        engine.close()
    return out


def test_each_rank_makes_its_shards_and_one_whole_parameter_at_a_time():
    results = ck.launch(_peaks, 4, MEMORY_CASES)
    for rank, res in enumerate(results):
        # colab_kit.sharded_init's worked example, exactly: 9,072 parameters kept, the peak while fc2.weight is cut
        ex = res["example"]
        assert ex["params"] == 9072 * 4 and ex["made"] == 12048 * 4, (rank, ex)
        dense, largest = _sizes(BIG)
        # measured (bytes, every rank): 1d 4,726,272; pp+tp 3,675,648 (first stage) and 4,724,224 (last),
        # against dense / 4 + largest = 4,733,952 and 10,547,200 for the dense model. The slack covers
        # small temporaries (a whole row-Linear bias and its copy) and what 1D keeps whole
        bound = dense // 4 + largest + (64 << 10)
        for case in ("1d", "pp+tp"):
            got = res[case]
            assert got["made"] <= bound, (rank, case, got, bound)
            assert got["made"] <= got["params"] + largest, (rank, case, got)  # shards + one whole parameter
            assert got["boost"] <= max(got["made"], got["params"] + got["grads"]) + (64 << 10), (rank, case, got)
            assert got["dense"] >= dense, (rank, case, got, dense)  # the dense path holds the whole model

"""The placement table (``colab_kit.placement``): every parameter's placement in DTensor's terms, as its
layer declared it, is checked against what the layer really holds. On every rank of every tensor mode
(1d, split_gather, 2d, 2.5d, 3d) and for GPT, BERT, ViT, Hugging Face GPT-2 (fused ``c_attn`` in three
parts) and Llama, ``Placed.local(dense value)`` must give exactly the rank's parameter, and the gradient
placements must say ``Partial()`` where the engine sums (2D's norms over the grid rows, split_gather's
norms over tp, everything over sp). A declaration that forgot 2D's transpose, or the fused parts,
does not reproduce the weights (checked, so the comparison can fail).
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import colab_kit as ck
from colab_kit.placement import Placed, PlacementTable, declare
from colab_kit.policy import policy_for

from tests.helpers import case_id
from tests.helpers import make

SGD = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731


def _dense(name):
    """The dense model as the engine shards it: the policy's ``prepare`` run (GPT-2's Conv1D -> Linear)."""
    model = make(name)
    policy = policy_for(model)
    if policy is not None and policy.prepare is not None:
        policy.prepare(model)
    return dict(model.named_parameters())


def _check(cases):
    out = {}
    for name, kw in cases:
        engine = ck.boost(make(name), SGD, ck.ParallelConfig(**kw))
        dense, table, mesh = _dense(name), engine.placement_table, engine.mesh
        bad, forgot, partial = [], [], {}
        for n, p in engine.module.named_parameters():
            placed = table[p]
            index = torch.arange(dense[n].numel()).view(dense[n].shape)
            if not torch.equal(placed.local(dense[n].detach(), mesh), p.detach()) or not torch.equal(
                    placed.local_index(dense[n].shape, mesh), placed.local(index, mesh)):
                bad.append(n)
            if (placed.transposed or placed.parts > 1) and dense[n].unique().numel() > 1:  # without them: no fit
                wrong = Placed(placed.shards, placed.partial)
                local = wrong.local(dense[n].detach(), mesh)
                forgot.append(local.shape == p.shape and torch.equal(local, p.detach()))
            partial[n] = placed.partial
        rows = ck.placements(engine)
        out[name, tuple(sorted(kw.items()))] = bad, forgot, partial, rows
        engine.close()
    return out


CASES = {
    2: [(m, dict(tp=2)) for m in ("gpt", "bert", "vit", "gpt2", "llama")]
       + [("gpt", dict(tp=2, sp_mode="split_gather")), ("gpt", dict(sp=2))],
    4: [(m, dict(tp=4, tp_mode="2d")) for m in ("gpt", "bert", "vit", "gpt2", "llama")],
    8: [("vit", dict(tp=8, tp_mode="3d")), ("gpt", dict(tp=8, tp_mode="3d")), ("bert", dict(tp=8, tp_mode="3d")),
        ("gpt2", dict(tp=8, tp_mode="3d")), ("llama", dict(tp=8, tp_mode="3d")),
        ("gpt", dict(tp=8, tp_mode="2.5d", tp_depth=2))],
}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world, cases in CASES.items():
        for rank, res in enumerate(ck.launch(_check, world, cases)):
            for key, value in res.items():
                out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("case", [c for cs in CASES.values() for c in cs],
                         ids=case_id)
def test_declared_placements_reproduce_every_shard(runs, case):
    for rank, (bad, forgot, _, rows) in enumerate(runs[case[0], tuple(sorted(case[1].items()))]):
        assert not bad, (rank, bad)
        assert not any(forgot), rank
        assert rows and all(set(r) == {"name", "shape", "placements"} for r in rows)


def test_gradient_placements_say_where_the_engine_sums(runs):
    def partial(case, rank=0):
        return runs[case][rank][2]
    two_d = partial(("gpt", (("tp", 4), ("tp_mode", "2d"))))
    assert two_d["blocks.0.ln1.weight"] == ("tp_row",) and two_d["blocks.0.mlp.fc1.weight"] == ()
    deep = partial(("gpt", (("tp", 8), ("tp_depth", 2), ("tp_mode", "2.5d"))))
    assert deep["blocks.0.mlp.fc1.weight"] == ("tp_dep",) and deep["blocks.0.ln1.bias"] == ("tp_dep", "tp_row")
    sg = partial(("gpt", (("sp_mode", "split_gather"), ("tp", 2))))
    assert sg["blocks.0.ln1.weight"] == ("tp",) and sg["blocks.0.mlp.fc1.weight"] == ()
    sp = partial(("gpt", (("sp", 2),)))
    assert all(axes == ("sp",) for axes in sp.values())
    one_d = partial(("gpt", (("tp", 2),)))
    assert all(axes == () for axes in one_d.values())  # 1D's activations are whole: nothing to sum
    rows = {r["name"]: r["placements"] for r in runs["gpt", (("tp", 4), ("tp_mode", "2d"))][0][3]}
    assert rows["blocks.0.mlp.fc1.weight"] == "tp_row: Shard(1), tp_col: Shard(0) (stored transposed)"
    assert rows["blocks.0.ln1.weight"] == "tp_row: Replicate(), tp_col: Shard(0); grad tp_row: Partial()"


def test_placed_in_dtensor_terms():
    p = Placed(((1, ("tp_row",)), (0, ("tp_col",))), ("tp_dep",), transposed=True)
    assert p.on("tp_row") == Shard(1) and p.on("tp_col") == Shard(0) and p.on("dp") == Replicate()
    assert p.grad_on("tp_dep") == Partial() and p.grad_on("tp_row") == Shard(1)
    lin = torch.nn.Linear(2, 2)
    declare(lin, "weight", {0: "tp"})
    table = PlacementTable(lin)
    assert table[lin.weight].on("tp") == Shard(0) and table[lin.bias] == Placed()

"""3D tensor parallelism (tp=8, q=2): every layer against its dense twin, the recorded bytes
of one Linear against the formula, and GPT training against one process.

Everything that needs processes runs in one spawn of 8 ranks (8 ranks on 2 cores start
slowly); the parent only compares what the ranks send back.
"""
import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.reference import single_process_losses
from colab_kit.models import GPT, GPTConfig
from colab_kit.tensor import check_model, sync_grads
from colab_kit.tensor.tp3d import (BATCH_AXES, INNER, RESIDUAL, Embedding3D, LayerNorm3D, Linear3D, Plan3D,
                                   VocabEmbedding3D, linear_comm_bytes, local_block)

GPT_CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
STEPS, BATCH = 3, 8
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
}
CFG = dict(tp=8, tp_mode="3d")
TRAIN_CASES = [("adamw", 1), ("sgd", 1), ("sgd", 2)]  # (optimizer, microbatches)
B, T, D_IN, D_OUT, VOCAB = 8, 3, 8, 12, 16  # B: 2 rows per rank; D_IN: q*q | in_features
TOL = dict(rtol=1e-5, atol=1e-6)


def _seeded(seed, cls, *args, **kw):
    torch.manual_seed(seed)
    module = cls(*args, **kw)
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make every parameter count
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def _grads_as_module(dense):
    """A copy of ``dense`` whose parameters are its gradients: ``from_dense`` of it gives each
    rank's expected gradient shards in the layer's own layout."""
    g = copy.deepcopy(dense)
    for pg, p in zip(g.parameters(), dense.parameters()):
        pg.data = p.grad.clone()
    return g


def _layer_checks(mesh):
    """(name, got, want) triples on this rank for every 3D layer kind, plus the Linear's records."""
    out, records = [], {}
    torch.manual_seed(0)
    x, tokens = torch.randn(B, T, D_IN) + 0.5, torch.randint(0, VOCAB, (B, T))

    def compare(name, layer, dense, make, x_dense, x_local, g_dense, g_local, rows_out, hidden_out):
        """Forward, backward of sum(y * g), parameter gradients after sync_grads, to_dense."""
        y_dense = dense(x_dense)
        (y_dense * g_dense).sum().backward()
        mark = len(mesh.log.records)
        y = layer(x_local)
        mid = len(mesh.log.records)
        (y * g_local).sum().backward()
        end = len(mesh.log.records)
        sync_grads(layer, mesh)
        out.append((f"{name} out", y, local_block(y_dense.detach(), mesh, rows_out, hidden_out)))
        want = make(_grads_as_module(dense))
        for (pname, p), wp in zip(layer.named_parameters(), want.parameters()):
            out.append((f"{name} {pname}.grad", p.grad, wp.detach()))
        for pd, pl in zip(dense.parameters(), layer.to_dense().parameters()):
            out.append((f"{name} to_dense", pl.detach(), pd.detach()))
        return mesh.log.records[mark:mid], mesh.log.records[mid:end]

    # Linear, both orientations: residual -> inner (in_axis tp_in), inner -> residual (tp_out)
    for name, (d_in, d_out), (rows_in, h_in), (rows_out, h_out) in [
            ("linear first", (D_IN, D_OUT), RESIDUAL, INNER), ("linear second", (D_OUT, D_IN), INNER, RESIDUAL)]:
        dense = _seeded(1, nn.Linear, d_in, d_out)
        axes = dict(in_axis=h_out, out_axis=h_in)
        make = lambda d: Linear3D.from_dense(d, mesh, **axes)  # noqa: E731
        xd = torch.randn(B, T, d_in, generator=torch.Generator().manual_seed(2)).requires_grad_()
        g = torch.randn(B, T, d_out, generator=torch.Generator().manual_seed(3))
        xl = local_block(xd.detach(), mesh, rows_in, h_in).requires_grad_()
        fwd, bwd = compare(name, make(dense), dense, make, xd, xl, g, local_block(g, mesh, rows_out, h_out),
                           rows_out, h_out)
        out.append((f"{name} x.grad", xl.grad, local_block(xd.grad, mesh, rows_in, h_in)))
        records[name] = {"forward": [(r.op, r.axis, r.bytes) for r in fwd],
                         "backward": [(r.op, r.axis, r.bytes) for r in bwd],
                         "formula": linear_comm_bytes(B * T, d_in, d_out, 2), "axes": axes}

    # LayerNorm over features split over tp_out (the residual stream's layout)
    rows, h = RESIDUAL
    dense = _seeded(4, nn.LayerNorm, D_IN)
    make = lambda d: LayerNorm3D.from_dense(d, mesh, axis=h)  # noqa: E731
    xd = x.clone().requires_grad_()
    xl = local_block(x, mesh, rows, h).requires_grad_()
    g = torch.randn(B, T, D_IN)
    compare("layernorm", make(dense), dense, make, xd, xl, g, local_block(g, mesh, rows, h), rows, h)
    out.append(("layernorm x.grad", xl.grad, local_block(xd.grad, mesh, rows, h)))

    # token embedding: tokens in the batch layout, activations out in the residual layout
    dense = _seeded(5, nn.Embedding, VOCAB, D_IN)
    make = lambda d: VocabEmbedding3D.from_dense(d, mesh, vocab_axis=INNER[1])  # noqa: E731
    g = torch.randn(B, T, D_IN)
    compare("token embedding", make(dense), dense, make, tokens, local_block(tokens, mesh, BATCH_AXES, None),
            g, local_block(g, mesh, rows, h), rows, h)
    out.append(("token table is V/q^2 x h/q", torch.tensor(make(dense).weight.shape),
                torch.tensor([VOCAB // 4, D_IN // 2])))

    # position embedding: whole ids, output broadcast onto the residual rows
    dense = _seeded(6, nn.Embedding, T, D_IN)
    make = lambda d: Embedding3D.from_dense(d, mesh, axis=h)  # noqa: E731
    g = torch.randn(B, T, D_IN)
    ids = torch.arange(T)
    compare("position embedding", make(dense), dense, make, ids, ids, g.sum(0), local_block(g, mesh, rows, h).sum(0),
            (), h)

    # LM head and vocab-parallel cross-entropy: logits stay split over the vocabulary
    dense = _seeded(7, nn.Linear, D_IN, VOCAB, bias=False)
    head = Linear3D.from_dense(dense, mesh, in_axis=INNER[1], out_axis=RESIDUAL[1])
    xd = x.clone().requires_grad_()
    loss_d = F.cross_entropy(dense(xd).flatten(0, 1), tokens.flatten())
    loss_d.backward()
    xl = local_block(x, mesh, rows, h).requires_grad_()
    logits = head(xl)
    out.append(("logits shape", torch.tensor(logits.shape), torch.tensor([B // 4, T, VOCAB // 2])))
    plan = Plan3D(mesh)
    mine = local_block(tokens, mesh, BATCH_AXES, None)
    loss_p = plan.loss(logits, mine)
    rows_d = local_block(dense(x).detach(), mesh, BATCH_AXES, None)
    out.append(("cross-entropy value", loss_p.detach(), F.cross_entropy(rows_d.flatten(0, 1), mine.flatten())))
    (loss_p / plan.batch_shards).backward()
    out.append(("cross-entropy x.grad", xl.grad, local_block(xd.grad, mesh, rows, h)))
    want = Linear3D.from_dense(_grads_as_module(dense), mesh, in_axis=INNER[1], out_axis=RESIDUAL[1])
    out.append(("head weight.grad", head.weight.grad, want.weight.detach()))

    # the whole GPT forward: this rank's rows and vocabulary slice of the dense logits
    model = GPT(GPT_CFG)
    toks = SyntheticTokens(64, 8).batch(0, B)[0]
    want = model(toks).detach()
    plan.parallelize(model)
    out.append(("gpt logits", model(local_block(toks, mesh, BATCH_AXES, None)),
                local_block(want, mesh, BATCH_AXES, INNER[1])))
    return [(n, a.detach(), b) for n, a, b in out], records


def _to_dense(model):
    """Swap every 3D layer of ``model`` for its gathered dense module (a collective)."""
    for name, mod in list(model.named_modules()):
        if hasattr(mod, "to_dense"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, mod.to_dense())
    return model


def _train(mesh):
    data, out = SyntheticTokens(64, 8, seed=1), {}
    for opt, mb in TRAIN_CASES:  # reuse the mesh where the config allows: its groups take seconds to build
        cfg = ck.ParallelConfig(**CFG, microbatches=mb)
        engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS[opt], cfg, mesh=mesh if mesh.config == cfg else None)
        losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
        axes = {(r["op"], r["axis"]) for r in engine.comm(last_step=True)}
        memory = engine.memory()
        dense = _to_dense(engine.module)
        params = torch.cat([p.detach().reshape(-1) for p in dense.parameters()])
        out[opt, mb] = {"losses": losses, "params": params, "memory": memory, "axes": axes}
    return out


def _all_checks():
    t0 = time.perf_counter()
    mesh = ck.ProcessMesh(ck.ParallelConfig(**CFG))
    t1 = time.perf_counter()
    layers = _layer_checks(mesh)
    t2 = time.perf_counter()
    train = _train(mesh)
    return layers, train, {"mesh": t1 - t0, "layers": t2 - t1, "training": time.perf_counter() - t2}


def _single_process(opt):
    return single_process_losses(GPT_CFG, OPTIMIZERS[opt], SyntheticTokens(64, 8, seed=1), STEPS, BATCH)


@pytest.fixture(scope="module")
def results():
    return ck.launch(_all_checks, 8)


def test_3d_layers_match_dense(results):
    for rank, ((checks, _), _, _) in enumerate(results):
        names = {n for n, _, _ in checks}
        for kind in ("linear first", "linear second", "layernorm", "token embedding", "position embedding"):
            assert {f"{kind} out", f"{kind} to_dense"} <= names, kind
        for name, got, want in checks:
            assert got.shape == want.shape, (rank, name)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank}, {name}: {m}")


def test_3d_linear_bytes_equal_the_formula(results):
    for rank, ((_, records), _, _) in enumerate(results):
        for name, rec in records.items():
            a, c = rec["axes"]["in_axis"], rec["axes"]["out_axis"]
            assert [r[:2] for r in rec["forward"]] == [("all_gather", a), ("all_gather", "tp_wt"),
                                                       ("reduce_scatter", c)], (rank, name)
            assert [r[:2] for r in rec["backward"]] == [("all_gather", c), ("reduce_scatter", a),
                                                        ("reduce_scatter", "tp_wt")], (rank, name)
            for phase in ("forward", "backward"):
                assert sum(r[2] for r in rec[phase]) == rec["formula"][phase], (rank, name, phase)


def test_3d_gpt_trains_like_one_process(results):
    dense_params = GPT(GPT_CFG).num_parameters() * 4
    refs = {opt: _single_process(opt) for opt in OPTIMIZERS}
    for case in TRAIN_CASES:
        ref_losses, ref_params = refs[case[0]]
        for rank, (_, train, _) in enumerate(results):
            got = train[case]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (case, rank)
            torch.testing.assert_close(got["params"], ref_params, rtol=1e-5, atol=5e-5)
            assert got["memory"]["params"] < dense_params / 4, (case, rank)  # shards, not copies
            assert {axis for _, axis in got["axes"]} == {"tp_in", "tp_wt", "tp_out", "tp"}, (case, rank)
        initial = torch.cat([p.detach().reshape(-1) for p in GPT(GPT_CFG).parameters()])
        assert (ref_params - initial).abs().max() > 100 * 5e-5  # the match is not trivial: 100x the atol
    print("3d spawn seconds (rank 0):", results[0][2])


def test_3d_sizes_that_do_not_divide_are_refused_without_processes():
    cfg = ck.ParallelConfig(**CFG)
    with pytest.raises(ck.ConfigError, match=r"d_model=34 not divisible by 4: tp_mode='3d' with tp=8 \(q=2\) "
                                             r"splits each Linear's input features over q\*q=4 ranks"):
        check_model(GPTConfig(vocab_size=64, d_model=34, n_heads=2, d_ff=128), cfg)
    with pytest.raises(ck.ConfigError, match=r"d_ff=66 not divisible by 4"):
        check_model(GPTConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=66), cfg)
    with pytest.raises(ck.ConfigError, match=r"vocab_size=62 not divisible by 4: .* splits the token table's "
                                             r"vocabulary over q\*q=4 ranks \(tp_wt and tp_in, the paper's V/q\^2"):
        ck.boost(GPT(GPTConfig(vocab_size=62, d_model=32, n_heads=4)), OPTIMIZERS["sgd"], cfg)
    with pytest.raises(ck.ConfigError, match=r"n_heads=1 not divisible by 2"):
        check_model(GPTConfig(vocab_size=64, d_model=32, n_heads=1), cfg)
    check_model(GPT_CFG, cfg)  # divides: no error
    check_model(GPTConfig(vocab_size=81, d_model=81, n_heads=3, d_ff=162),  # vocabulary 81 = 9 * 9 too
                ck.ParallelConfig(tp=27, tp_mode="3d"))  # q=3: d_model 81 = 9 * 9


def test_3d_linear_comm_formula():
    assert linear_comm_bytes(64, 32, 128, 2) == {"forward": 11264, "backward": 10240}
    # q=1 is one process: it hands every matrix whole to (no-op) collectives
    assert linear_comm_bytes(4, 3, 5, 1, bytes_per_elem=2) == {"forward": 2 * (12 + 15 + 20),
                                                                "backward": 2 * (20 + 12 + 15)}
    with pytest.raises(ValueError, match="does not split into 8 equal parts"):
        linear_comm_bytes(6, 3, 5, 2)

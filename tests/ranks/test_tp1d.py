"""1D tensor parallelism (Megatron): every layer against its dense twin, and GPT training
against one process. Layer checks for tp=4 and tp=2 (inside dp=2) run in one spawn."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from colab_kit.tensor import check_model
from colab_kit.tensor.tp1d import ColumnLinear, RowLinear, VocabEmbedding, linear_comm_bytes, Plan1D

from tests.helpers import BATCH, GPT_CFG, OPTIMIZERS, STEPS, assert_params_match

ROWS, D_IN, D_OUT, VOCAB = 6, 8, 12, 16


def _dense(seed, cls, *args, **kw):
    torch.manual_seed(seed)
    return cls(*args, **kw)


def _check_layers(cfg_kwargs):
    """On one rank: each 1D layer's output and gradients vs the dense layer's; returns failures."""
    mesh = ck.ProcessMesh(ck.ParallelConfig(**cfg_kwargs))
    n, i = mesh.size("tp"), mesh.rank("tp")
    torch.manual_seed(0)
    x, g_out = torch.randn(ROWS, D_IN), torch.randn(ROWS, D_OUT)
    tokens = torch.randint(0, VOCAB, (ROWS,))
    out = {}

    def close(name, got, want):
        out[name] = torch.allclose(got, want, rtol=1e-5, atol=1e-6)

    # column-parallel: whole input, this rank's output features
    dense = _dense(1, nn.Linear, D_IN, D_OUT)
    xd = x.clone().requires_grad_()
    (dense(xd) * g_out).sum().backward()
    layer = ColumnLinear.from_dense(dense, mesh)
    xp = x.clone().requires_grad_()
    mark = len(mesh.log.records)
    y = layer(xp)
    close("column out", y, dense(x).chunk(n, -1)[i])
    (y * g_out.chunk(n, -1)[i]).sum().backward()
    close("column x.grad", xp.grad, xd.grad)
    close("column w.grad", layer.weight.grad, dense.weight.grad.chunk(n, 0)[i])
    close("column b.grad", layer.bias.grad, dense.bias.grad.chunk(n, 0)[i])
    out["column bytes"] = sum(r.bytes for r in mesh.log.records[mark:]) == sum(
        linear_comm_bytes(ROWS, D_IN, D_OUT, "column").values())
    close("column to_dense", layer.to_dense().weight, dense.weight)

    # row-parallel: this rank's input features, whole output
    dense = _dense(2, nn.Linear, D_IN, D_OUT)
    xd = x.clone().requires_grad_()
    (dense(xd) * g_out).sum().backward()
    layer = RowLinear.from_dense(dense, mesh)
    xp = x.chunk(n, -1)[i].clone().requires_grad_()
    mark = len(mesh.log.records)
    y = layer(xp)
    close("row out", y, dense(x))
    (y * g_out).sum().backward()
    close("row x.grad", xp.grad, xd.grad.chunk(n, -1)[i])
    close("row w.grad", layer.weight.grad, dense.weight.grad.chunk(n, 1)[i])
    close("row b.grad", layer.bias.grad, dense.bias.grad)
    out["row bytes"] = sum(r.bytes for r in mesh.log.records[mark:]) == sum(
        linear_comm_bytes(ROWS, D_IN, D_OUT, "row").values())
    out["row axis"] = {r.axis for r in mesh.log.records[mark:]} == {"tp"}
    close("row to_dense", layer.to_dense().weight, dense.weight)

    # vocabulary-split embedding
    dense = _dense(3, nn.Embedding, VOCAB, D_OUT)
    (dense(tokens) * g_out).sum().backward()
    layer = VocabEmbedding.from_dense(dense, mesh)
    y = layer(tokens)
    close("embedding out", y, dense(tokens))
    (y * g_out).sum().backward()
    close("embedding w.grad", layer.weight.grad, dense.weight.grad.chunk(n, 0)[i])
    close("embedding to_dense", layer.to_dense().weight, dense.weight)

    # LM head with vocab-parallel cross-entropy: never the full logits
    dense = _dense(4, nn.Linear, D_IN, VOCAB, bias=False)
    xd = x.clone().requires_grad_()
    loss_d = F.cross_entropy(dense(xd), tokens)
    loss_d.backward()
    layer = ColumnLinear.from_dense(dense, mesh)
    xp = x.clone().requires_grad_()
    logits = layer(xp)
    out["head logits are split"] = logits.shape[-1] == VOCAB // n
    loss_p = Plan1D(mesh).loss(logits, tokens)
    close("cross-entropy value", loss_p, loss_d)
    loss_p.backward()
    close("cross-entropy x.grad", xp.grad, xd.grad)
    close("head w.grad", layer.weight.grad, dense.weight.grad.chunk(n, 0)[i])

    # whole GPT forward: vocab-split logits equal the dense model's slice
    model = GPT(GPT_CFG)
    tokens2 = SyntheticTokens(64, 16).batch(0, 2)[0]
    want = model(tokens2)
    Plan1D(mesh).parallelize(model)
    close("gpt logits", model(tokens2), want.chunk(n, -1)[i])
    return {k: v for k, v in out.items() if not v}


def _train(cfgs):
    from colab_kit.tensor.inspect import dense_state

    data, out = SyntheticTokens(64, 16, seed=1), {}
    for kw in cfgs:
        for opt in OPTIMIZERS:
            engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
            losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
            out[tuple(sorted(kw.items())), opt] = losses, dense_state(engine.module)
    return out


def _layers_and_training(layer_cfgs, train_cfgs):
    return [_check_layers(kw) for kw in layer_cfgs], _train(train_cfgs)


@pytest.mark.parametrize("world, layer_cfgs, train_cfgs", [
    (2, [dict(tp=2)], [dict(tp=2)]),
    (4, [dict(tp=4), dict(dp=2, tp=2)], [dict(tp=4), dict(dp=2, tp=2), dict(dp=2, tp=2, microbatches=2)]),
])
def test_1d_layers_and_training(world, layer_cfgs, train_cfgs, gpt_references):
    results = ck.launch(_layers_and_training, world, layer_cfgs, train_cfgs)
    for rank, (layer_failures, losses) in enumerate(results):
        for cfg, failures in zip(layer_cfgs, layer_failures):
            assert failures == {}, (rank, cfg, failures)
        assert len(losses) == 2 * len(train_cfgs)
        for (cfg, opt), (got, params) in losses.items():
            assert got == pytest.approx(gpt_references[opt][0], rel=1e-5), (rank, cfg, opt)
            assert_params_match(params, gpt_references[opt][1], opt, (rank, cfg, opt))


def test_1d_sizes_that_do_not_divide_are_refused_without_processes():
    cfg = ck.ParallelConfig(tp=4)
    with pytest.raises(ck.ConfigError, match=r"n_heads=6 not divisible by 4: tp_mode='1d' splits attention heads"):
        check_model(GPTConfig(vocab_size=64, d_model=48, n_heads=6), cfg)
    with pytest.raises(ck.ConfigError, match=r"vocab_size=50 not divisible by 4"):
        ck.boost(GPT(GPTConfig(vocab_size=50, d_model=32, n_heads=4)), OPTIMIZERS["sgd"], cfg)
    check_model(GPTConfig(vocab_size=64, d_model=32, n_heads=4), cfg)  # divides: no error


def test_an_unknown_tensor_mode_has_no_plan():
    from colab_kit.tensor import plan_class

    with pytest.raises(ck.ConfigError, match="unknown tp_mode '4d'"):
        plan_class("4d")

"""Zero-bubble backward split (``colab_kit.tensor.zero_bubble``), in one process.

On real pipeline stages of a GPT (dense, and 1D tensor-parallel on the fake backend): I + W
costs one backward B in FLOPs (measured with FlopCounterMode) and gives B's gradients; W is
exactly the linears' weight-gradient matmuls; after I the graph is gone and the store keeps
less than the forward saved; W fires the parameters' post-accumulate-grad hooks (the dp
buckets' trigger); W before I, or twice, says so.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import colab_kit as ck
from colab_kit.models import GPT, GPTConfig
from colab_kit.pipeline.stage import split_model
from colab_kit.tensor.zero_bubble import DeferredLinear, WeightGradStore, split_linear, use_split_backward
from colab_kit.tensor.tp1d import ColumnLinear, RowLinear

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
B, T = 4, 16
LINEARS = (nn.Linear, ColumnLinear, RowLinear)


def _stage(index: int, model=None, config=None):
    """Stage ``index`` of a pp=2 split, its linears made split-aware, and an input and output grad."""
    config = config or ck.ParallelConfig(pp=2)
    stage = split_model(model or GPT(CFG), config, index)[0]
    use_split_backward(stage)
    gen = torch.Generator().manual_seed(index)
    x = (torch.randint(0, CFG.vocab_size, (B, T), generator=gen) if index == 0 else
         torch.randn(B, T, CFG.d_model, generator=gen).requires_grad_())
    return stage, x


def _out_grad(y):
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(7))


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _linears(stage):
    return [m for m in stage.modules() if isinstance(m, LINEARS)]


def _check_split(make):
    """B on one copy, I then W on another: FLOPs add up, W is the linears' dW, the gradients agree."""
    (sb, xb), (si, xi) = make(), make()
    yb, yi = sb(xb), si(xi)
    g = _out_grad(yb)
    f_b = _flops(lambda: torch.autograd.backward(yb, g))
    store = WeightGradStore("test I")

    f_i = _flops(lambda: store.backward_input(yi, g))
    f_w = _flops(store.run)
    dw = sum(2 * B * T * m.weight.shape[0] * m.weight.shape[1] for m in _linears(si))
    assert f_w == dw > 0  # W is the linears' weight-gradient matmuls, nothing else
    assert abs(f_i + f_w - f_b) <= 0.01 * f_b, (f_i, f_w, f_b)
    for (name, p), q in zip(sb.named_parameters(), si.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if xb.is_floating_point():
        torch.testing.assert_close(xi.grad, xb.grad, rtol=1e-6, atol=1e-6)
    return f_i, f_w, f_b


@pytest.mark.parametrize("index", [0, 1], ids=["first stage", "last stage"])
def test_i_plus_w_is_one_backward_dense(index):
    f_i, f_w, f_b = _check_split(lambda: _stage(index))
    # and B through the split function costs what nn.Linear's own backward costs
    plain = split_model(GPT(CFG), ck.ParallelConfig(pp=2), index)[0]
    _, x = _stage(index)
    y = plain(x)
    assert _flops(lambda: torch.autograd.backward(y, _out_grad(y))) == f_b


def test_use_split_backward_keeps_the_model_and_is_idempotent():
    model = GPT(CFG)
    stage = split_model(model, ck.ParallelConfig(pp=2), 1)[0]
    keys = list(stage.state_dict())
    n = use_split_backward(stage)
    assert n == 4 * 2 + 1  # qkv, proj, fc1, fc2 of blocks 2-3, and the head
    assert use_split_backward(stage) == 0 and list(stage.state_dict()) == keys
    assert all(type(m) is not nn.Linear for m in stage.modules())
    assert isinstance(stage.model.head, DeferredLinear) and isinstance(stage.model.head, nn.Linear)
    assert type(model.blocks[0].attn.qkv) is nn.Linear  # the stage on the other rank is untouched


def test_graph_freed_after_i_and_store_keeps_only_linear_inputs_and_grads():
    """After I the graph is gone: of what the forward saved, only the linears' inputs live on
    (less than half of it here: attention, LayerNorm and GELU tensors are freed), beside each
    linear's output gradient. For this GPT the output gradients (qkv 3d, fc1 4d wide) make the
    store about as large as the forward's saved tensors: the split trades the graph for them."""
    stage, x = _stage(1)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = stage(x)
    g = _out_grad(y)
    store = WeightGradStore()
    store.backward_input(y, g)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.backward(y, g)
    linears = _linears(stage)
    assert len(store.entries) == len(linears)
    ids = {id(m.weight): m for m in linears}
    for w, bias, xs, gs in store.entries:  # only each linear's input and output gradient
        m = ids[id(w)]
        assert bias is m.bias
        assert xs.shape == (B, T, m.in_features) and gs.shape == (B, T, m.out_features)
        assert not xs.requires_grad and xs.grad_fn is None
        assert xs.untyped_storage().data_ptr() in saved  # one of the forward's, kept
    kept = {xs.untyped_storage().data_ptr() for _, _, xs, _ in store.entries}
    assert sum(saved[k] for k in kept) < 0.5 * sum(saved.values())
    out_grads = sum(4 * B * T * m.out_features for m in linears)
    assert store.nbytes == sum(saved[k] for k in kept) + out_grads


def test_hooks_fire_on_w_and_gradients_accumulate_in_place():
    stage, x = _stage(1)
    params = list(stage.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))  # like data.DataParallel: .grad views a bucket
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    linear_params = {id(t) for m in _linears(stage) for t in (m.weight, m.bias) if t is not None}
    y = stage(x)
    store = WeightGradStore()
    store.backward_input(y, _out_grad(y))
    in_i = set(fired)
    assert in_i == {id(p) for p in params} - linear_params  # LayerNorms now, the linears wait
    fired.clear()
    store.run()
    assert sorted(fired) == sorted(linear_params)  # each linear parameter once
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    assert flat.abs().sum() > 0


def test_w_with_ready_adds_in_place_and_tells_each_parameter_once():
    """The executor's W, ``run(ready=...)``: every dW goes straight into the existing ``.grad`` (a
    bucket's flat buffer), ``ready`` is told once per linear parameter in place of the hooks, and
    FLOPs and gradients are B's."""
    (sb, xb), (si, xi) = _stage(1), _stage(1)
    params = list(si.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    hooked = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: hooked.append(id(p)))
    yb, yi = sb(xb), si(xi)
    g = _out_grad(yb)
    f_b = _flops(lambda: torch.autograd.backward(yb, g))
    store = WeightGradStore()
    f_i = _flops(lambda: store.backward_input(yi, g))
    hooked.clear()
    told = []
    f_w = _flops(lambda: store.run(ready=lambda p: told.append(id(p))))
    linears = _linears(si)
    assert f_w == sum(2 * B * T * m.weight.shape[0] * m.weight.shape[1] for m in linears)
    assert abs(f_i + f_w - f_b) <= 0.01 * f_b, (f_i, f_w, f_b)
    assert hooked == [] and sorted(told) == sorted(id(t) for m in linears for t in (m.weight, m.bias) if t is not None)
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    for (name, p), q in zip(sb.named_parameters(), params):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_w_with_ready_tells_a_shared_weight_once_after_its_last_part():
    torch.manual_seed(0)
    lin, ref = nn.Linear(5, 5), nn.Linear(5, 5)
    ref.load_state_dict(lin.state_dict())
    use_split_backward(lin)
    x = torch.randn(3, 5, requires_grad=True)
    torch.autograd.backward(ref(ref(x.detach().requires_grad_())), torch.ones(3, 5))
    store = WeightGradStore()
    store.backward_input(lin(lin(x)), torch.ones(3, 5))
    assert len(store.entries) == 2  # one per use, the same weight and bias
    told = []
    store.run(ready=lambda p: told.append((id(p), p.grad.clone())))  # lin.weight.grad is None before W
    assert [i for i, _ in told] == [id(lin.weight), id(lin.bias)]
    torch.testing.assert_close(told[0][1], ref.weight.grad, rtol=1e-6, atol=1e-6)  # whole when told
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


def test_grad_buckets_ready_counts_like_the_hook():
    """``DataParallel.ready(p)`` is what ``p``'s post-accumulate-grad hook does: a bucket launches its
    all-reduce when every parameter in it is ready, once per backward."""
    from types import SimpleNamespace

    from colab_kit.zero.stage0 import DataParallel

    params = [nn.Parameter(torch.randn(64, 64)) for _ in range(4)]
    mesh = SimpleNamespace(size=lambda axis: 1, device=torch.device("cpu"))
    buckets = DataParallel(params, mesh, bucket_bytes=2 * 64 * 64 * 4)  # two buckets of two
    launched = []
    buckets._launch = lambda b: launched.append(b.index)
    buckets.arm(sync=True)
    for p in params[::-1]:  # the order backward produces gradients
        buckets.ready(p)
    buckets.ready(nn.Parameter(torch.zeros(1)))  # not in any bucket: ignored
    assert launched == [0, 1]
    buckets.arm(sync=True)
    sum(p.sum() for p in params).backward()  # the hooks: the same counting
    assert launched == [0, 1, 0, 1]


def test_w_before_i_or_twice_is_an_error():
    with pytest.raises(RuntimeError, match="before its I pass"):
        WeightGradStore("1W0").run()
    stage, x = _stage(1)
    y = stage(x)
    store = WeightGradStore("1W0")
    store.backward_input(y, _out_grad(y))
    with pytest.raises(RuntimeError, match="one I pass fills a store once"):
        store.__enter__()
    store.run()
    with pytest.raises(RuntimeError, match="second time"):
        store.run()


def test_without_a_store_split_linear_is_a_linear():
    x = torch.randn(3, 5, 6, requires_grad=True)
    w, b = torch.randn(4, 6, requires_grad=True), torch.randn(4, requires_grad=True)
    got = torch.autograd.grad(split_linear(x, w, b).sin().sum(), (x, w, b))
    want = torch.autograd.grad(nn.functional.linear(x, w, b).sin().sum(), (x, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


@pytest.fixture
def fake_tp_rank():
    """This process as rank ``r`` of a pp=2 x tp=2 world on the fake backend: 1D layers without workers."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        config = ck.ParallelConfig(pp=2, tp=2)
        return ck.ProcessMesh(config), config

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 2], ids=["first stage", "last stage"])
def test_i_plus_w_is_one_backward_tp1d(fake_tp_rank, rank):
    from colab_kit.tensor import plan_for

    mesh, config = fake_tp_rank(rank)
    index = mesh.rank("pp")

    def make():
        return _stage(index, plan_for(mesh).parallelize(GPT(CFG)), config)

    stage, _ = make()
    assert any(isinstance(m, (ColumnLinear, RowLinear)) for m in stage.modules())
    assert not any(type(m) in (nn.Linear, DeferredLinear) for m in stage.modules())
    _check_split(make)


def test_executor_w_before_i_or_twice_names_the_action():
    from types import SimpleNamespace

    from colab_kit.pipeline import parse
    from colab_kit.pipeline.executor import PipelineExecutor

    pipe = SimpleNamespace(me=1, _saved={(1, 0): ("x", "y")}, _bytes={(1, 0): 8}, _held=8)
    with pytest.raises(RuntimeError, match="ran 1W0 before 1I0"):
        PipelineExecutor._do_W(pipe, parse("1W0"), 1, 0)
    with pytest.raises(RuntimeError, match="ran 1W1 without an F and I before it, or a second time"):
        PipelineExecutor._do_W(pipe, parse("1W1"), 1, 1)
    assert pipe._saved and pipe._held == 8  # nothing dropped by the refusal


def test_a_linear_whose_input_needs_no_gradient_gets_its_weight_gradient_in_i():
    """Nothing to hurry for such a layer (no dx): autograd must still reach it, and it is exact."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    ref = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    ref.load_state_dict(net.state_dict())
    use_split_backward(net)
    x, g = torch.randn(4, 6), torch.randn(4, 3)
    torch.autograd.backward(ref(x), g)
    store = WeightGradStore()
    store.backward_input(net(x), g)
    assert net[0].weight.grad is not None and net[2].weight.grad is None  # first now, last deferred
    assert len(store.entries) == 1
    store.run()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)

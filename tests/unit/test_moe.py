"""The MoE layer in one process: routing against a naive per-token reference, ties, renormalisation, the
balancing and z losses against their formulas, capacity against a naive reference, the bias update, gradients,
experts that receive no token, top_k equal to the experts, the three expert computes, the config's rules."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import colab_kit as ck
from colab_kit.models import GPT, GPTConfig, update_router_bias
from colab_kit.models.experts import expert_compute
from colab_kit.models.moe import MoE, keep_within_capacity, route, top_k

SMALL = dict(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_expert=16)


def naive_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sort the scores (ties to the lower index), renormalise, run each expert's MLP."""
    h = x.reshape(-1, x.shape[-1])
    out = []
    e = layer.experts
    for t in h:
        logits = layer.router.weight @ t
        p = logits.softmax(-1) if layer.kind == "softmax" else logits.sigmoid()
        sel = sorted(range(layer.n), key=lambda i: (-float(p[i].detach() + layer.score_bias[i]), i))[:layer.k]
        w = p[sel] / p[sel].sum()
        y = sum(w[j] * (F.gelu(t @ e.w_in[i] + e.b_in[i]) @ e.w_out[i] + e.b_out[i]) for j, i in enumerate(sel))
        out.append(y + (layer.shared(t) if layer.shared is not None else 0))
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("kw", [dict(), dict(router="sigmoid", shared_experts=1), dict(top_k=4), dict(top_k=1)])
def test_layer_equals_the_naive_per_token_reference(kw):
    cfg = GPTConfig(**SMALL, n_experts=4, **{"top_k": 2, **kw})
    layer = GPT(cfg).blocks[0].mlp
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), naive_moe(layer, x), rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_weights_renormalise():
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25], [0.4, 0.1, 0.4, 0.1]])
    assert top_k(scores, 2).tolist() == [[1, 2], [0, 1], [0, 2]]
    assert top_k(scores.flip(0), 2).flip(0).tolist() == [[1, 2], [0, 1], [0, 2]]  # any row order
    probs, chosen, w = route(torch.zeros(5, 4), 3)  # all equal: experts 0, 1, 2, weights 1/3
    assert chosen.tolist() == [[0, 1, 2]] * 5 and torch.allclose(w, torch.full((5, 3), 1 / 3))
    _, _, w = route(torch.randn(7, 6), 2, "sigmoid")
    torch.testing.assert_close(w.sum(-1), torch.ones(7))


def test_losses_equal_their_formulas_over_every_layer():
    cfg = GPTConfig(**SMALL, n_experts=4, top_k=2, aux_loss=0.3, z_loss=0.05)
    model = GPT(cfg)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(2))
    inputs = []
    for b in model.blocks:
        b.mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, 16)))
    model(x)
    want = 0.0
    for b, h in zip(model.blocks, inputs):
        logits = b.mlp.router(h)
        p = logits.softmax(-1)
        chosen = p.topk(2).indices
        f = torch.stack([(chosen == i).sum() for i in range(4)]).float() / (h.shape[0] * 2)
        want = want + (0.3 * 4 * (f * p.mean(0)).sum() + 0.05 * logits.logsumexp(-1).square().mean()) / 2
    torch.testing.assert_close(model.aux_loss(), want)


def test_uniform_router_balancing_loss_is_one():
    cfg = GPTConfig(**{**SMALL, "n_layers": 1}, n_experts=4, top_k=4, aux_loss=1.0)
    model = GPT(cfg)
    with torch.no_grad():
        model.blocks[0].mlp.router.weight.zero_()
    model(torch.zeros(2, 8, dtype=torch.long))
    assert float(model.aux_loss()) == pytest.approx(1.0)


def naive_keep(chosen: torch.Tensor, n: int, cap: int) -> torch.Tensor:
    """Slot by slot, token by token: each expert keeps assignments until it holds ``cap``."""
    keep = torch.zeros_like(chosen, dtype=torch.bool)
    held = [0] * n
    for j in range(chosen.shape[1]):
        for t in range(chosen.shape[0]):
            e = int(chosen[t, j])
            if held[e] < cap:
                keep[t, j], held[e] = True, held[e] + 1
    return keep


def test_capacity_drops_what_the_naive_order_drops_whatever_the_split():
    gen = torch.Generator().manual_seed(3)
    chosen = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(40)])
    chosen[:12] = torch.tensor([0, 1])  # crowd experts 0 and 1
    want = naive_keep(chosen, 4, 15)
    assert (~want).sum() > 0
    assert torch.equal(keep_within_capacity(chosen, 4, 15), want)
    # four pieces of ten rows, each told what the rows before it and the whole batch hold
    per = torch.stack([F.one_hot(c, 4).sum(0) for c in chosen.split(10)])
    got = [keep_within_capacity(c, 4, 15, per[:r].sum(0), per.sum(0)) for r, c in enumerate(chosen.split(10))]
    assert torch.equal(torch.cat(got), want)


def test_a_capacity_model_drops_and_reports_it():
    cfg = GPTConfig(**SMALL, n_experts=4, top_k=2, capacity_factor=0.5)
    model = GPT(cfg)
    model(torch.randint(0, 32, (4, 8)))
    layer = model.blocks[0].mlp
    assert layer.last["dropped"] >= 4 * 8 * 2 - 4 * math.ceil(0.5 * 2 * 32 / 4)


@pytest.mark.parametrize("kw", [dict(capacity_factor=0.5), dict(router="sigmoid")])
def test_the_records_stay_on_the_device_until_the_steps_end(kw):
    """Under the engine's ``MoEStep`` a layer keeps what it routed as tensors (no host read per layer and
    microbatch); ``step_layers`` reads them once and gives the numbers, ints and floats, the per-value reads
    gave: counts and mine the router's own choices, drops and losses of the layer."""
    from colab_kit.expert import records as moe_records
    from colab_kit.models.moe_context import MoEStep, at
    from tests.helpers.moe import old_records

    cfg = GPTConfig(**{**SMALL, "n_layers": 3}, n_experts=4, top_k=2, aux_loss=0.01, z_loss=0.001, **kw)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(6)
    steps, chosen = [MoEStep(pieces=2, grad_scale=0.5) for _ in range(2)], []
    model.blocks[0].mlp.router.register_forward_hook(lambda m, a, out: chosen.append(
        route(out, 2, cfg.router)[1]))
    for step in steps:
        with at(step):
            (model(torch.randint(0, 32, (4, 8), generator=gen)).sum() / 2).backward()
    for step in steps:
        assert sorted(step.seen) == [0, 1, 2]
        for seen in step.seen.values():
            for key in ("counts", "mine", "balance", "z") + (("dropped",) if "capacity_factor" in kw else ()):
                assert isinstance(seen[key], torch.Tensor) and not seen[key].requires_grad, (key, seen[key])
    got, want = moe_records.step_layers(steps), old_records(steps)
    assert got == want
    rec = got[0]
    assert all(type(c) is int for c in rec["counts"] + rec["mine"]) and type(rec["dropped"]) is int
    assert type(rec["balance"]) is float and type(rec["z"]) is float
    routed = sum(torch.bincount(c.reshape(-1), minlength=4) for c in chosen).tolist()
    assert rec["counts"] == rec["mine"] == routed and sum(routed) == 2 * 4 * 8 * 2
    assert (rec["dropped"] > 0) == ("capacity_factor" in kw) and rec["balance"] > 0 and rec["z"] > 0


def test_bias_update_follows_the_load_and_selects_only():
    cfg = GPTConfig(**{**SMALL, "n_layers": 1}, n_experts=4, top_k=1, router_bias_update=0.1)
    model = GPT(cfg)
    layer = model.blocks[0].mlp
    layer.load = torch.tensor([10.0, 2.0, 2.0, 2.0])
    update_router_bias(model)
    assert layer.score_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert layer.load.sum() == 0
    probs, chosen, w = route(torch.tensor([[1.0, 0.95, 0.0, 0.0]]), 1, bias=layer.score_bias)
    assert chosen.tolist() == [[1]] and float(w) == 1.0  # selected by the bias, weighted by the score
    model.train()
    model(torch.zeros(1, 8, dtype=torch.long))
    assert layer.load.sum() == 8  # every token counted once (top-1)


def test_gradients_against_the_naive_reference_and_empty_experts():
    cfg = GPTConfig(**SMALL, n_experts=6, top_k=2, shared_experts=1)
    layer = GPT(cfg).blocks[0].mlp
    with torch.no_grad():
        layer.router.weight[4:] = -5.0  # experts 4 and 5 never chosen
    x = torch.rand(2, 4, 16, generator=torch.Generator().manual_seed(4)) + 0.1  # positive: rows 4, 5 score low
    grads = []
    for fn in (layer, lambda x: naive_moe(layer, x)):
        layer.zero_grad()
        fn(x).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6, msg=n)
    assert grads[0]["experts.w_in"][4:].abs().sum() == 0  # a (zero) gradient, not None
    assert grads[0]["router.weight"].abs().sum() > 0


def test_the_three_expert_computes_agree():
    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(*s, generator=gen).requires_grad_() for s in ((4, 8, 12), (4, 12), (4, 12, 8), (4, 8))]
    x = torch.randn(10, 8, generator=gen)
    counts = torch.tensor([3, 0, 7, 0])
    outs = {how: expert_compute(x, counts, *ws, how=how) for how in ("loop", "grouped_mm", "padded")}
    for how in ("grouped_mm", "padded"):
        torch.testing.assert_close(outs[how], outs["loop"], rtol=1e-5, atol=1e-5)


def test_group_bias_sums_each_experts_rows_in_fp32():
    """The bias gradient of the grouped form is each expert's sum accumulated in fp32 then rounded once: in bf16
    it equals the fp32 sum cast to bf16 exactly (a gather's bf16 scatter-add missed by 31% on a GPU), an expert
    without rows gets zero; a wrong sum (the first expert's rows only) is caught."""
    from colab_kit.models.experts import GroupBias
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3000, 0, 1096])
    expert_of = torch.repeat_interleave(torch.arange(3), counts)
    grad = torch.randn(4096, 16, generator=gen).bfloat16()
    b = torch.zeros(3, 16, dtype=torch.bfloat16, requires_grad=True)
    x = torch.zeros(4096, 16, dtype=torch.bfloat16, requires_grad=True)
    GroupBias.apply(x, b, expert_of, counts).backward(grad)
    want = torch.stack([grad[:3000].float().sum(0), torch.zeros(16), grad[3000:].float().sum(0)]).bfloat16()
    assert torch.equal(b.grad, want) and torch.equal(x.grad, grad)
    assert not torch.equal(b.grad[2], want[0])


def test_dense_gpt_is_unchanged_and_bad_configs_state_the_rule():
    a, b = GPT(GPTConfig(**SMALL)), GPT(GPTConfig(**SMALL, top_k=9, router="x"))  # ignored without experts
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not any(isinstance(m, MoE) for m in a.modules()) and a.aux_loss() == 0.0
    for kw, rule in ((dict(n_experts=4, top_k=5), "top_k=4"), (dict(n_experts=4, moe_every=3), "moe_every=1"),
                     (dict(n_experts=4, router="relu"), "'softmax' or 'sigmoid'"),
                     (dict(n_experts=4, capacity_factor=0.0), "1.25"), (dict(n_experts=-1), "0 (a dense MLP)")):
        with pytest.raises(ck.ConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")):
            GPTConfig(**SMALL, **kw)
    moe = GPT(GPTConfig(**SMALL, n_experts=4, moe_every=2))
    assert isinstance(moe.blocks[1].mlp, MoE) and not isinstance(moe.blocks[0].mlp, MoE)
    meta = GPT(GPTConfig(**SMALL, n_experts=4), device="meta")
    for name, p in GPT(GPTConfig(**SMALL, n_experts=4)).named_parameters():  # rebuilt by name alone
        assert torch.equal(meta.init_parameter(name, torch.empty(p.shape)), p), name


def test_routing_reads_nothing_to_the_host_without_a_capacity(monkeypatch):
    """On a GPU a device value read to the host is a sync that drains the host's queue of kernels. A dropless MoE
    layer routes, trains and computes both losses without one: the batch's token count stays on the device. With
    a capacity factor two a layer: the token count (the capacity is a host number) and the drops
    (``MoE.last``). ``F.one_hot`` checks its classes
    with two reads on CPU only (on CUDA scatter's device assert does), so it is counted here through an
    equivalent without them."""
    from colab_kit.engine.loss import lm_loss
    from colab_kit.models import moe_loss
    from colab_kit.observe.ops import count_ops
    monkeypatch.setattr(F, "one_hot", lambda t, n: (t[..., None] == torch.arange(n, device=t.device)).long())
    base = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2, d_expert=32,
                aux_loss=0.1, z_loss=0.01, shared_experts=1)
    x, y = ck.datasets.SyntheticTokens(64, 16, seed=1).batch(0, 4)
    reads = {}
    for name, extra in (("dropless", {}), ("capacity", {"capacity_factor": 1.0})):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**base, **extra))
        reads[name] = count_ops(lambda: (lm_loss(model(x), y) + moe_loss(model)).backward())["host_reads"]
    assert reads == {"dropless": 0, "capacity": 2 * 2}, reads


@pytest.mark.parametrize("drop", [False, True])
def test_combine_keeps_its_slots_and_weights_not_a_second_copy(drop):
    """``combine`` gathers the expert outputs into their slots: autograd keeps the slots (``e N k h``), the weights
    and the int64 gather index, not the outputs themselves beside them (``index_copy`` into zeros kept its source
    too: ``e M h`` more); the result is the scatter's, dropped slots zero."""
    from colab_kit.models.experts import combine, dispatch
    n, k, d, e = 6, 2, 8, 4
    chosen = torch.tensor([[2, 0], [0, 1], [2, 1], [1, 0], [0, 2], [1, 2]])
    keep = torch.rand(n, k, generator=torch.Generator().manual_seed(0)) > 0.3 if drop else None
    order, _ = dispatch(chosen, keep, 3)
    out = torch.randn(len(order), d, requires_grad=True)
    weights = torch.rand(n, k, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = combine(out, order, weights)
    slots = torch.zeros(n * k, d).index_copy(0, order, out.detach())
    assert torch.equal(y.detach(), (slots.view(n, k, d) * weights.detach()[..., None]).sum(1))
    saved.pop(weights.untyped_storage().data_ptr(), None)
    assert sum(saved.values()) == e * n * k * d + 8 * n * k  # the slots and the index (the weights: their own)

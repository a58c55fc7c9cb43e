"""The Hugging Face MoE policies in one process, no ranks: they find the MoE layers (and leave the dense ones
out), a prepared model still computes what HF computes outside the engine, and bad input is a ConfigError
that states the rule and a value that works, raised by ``ck.boost`` before any process group exists."""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.engine.checks import count_router_loss
from colab_kit.expert import expert_modules
from colab_kit.models.hf_moe import RouterLoss
from colab_kit.policy import policy_for
from tests.helpers.hf_moe import MODELS, build

SGD = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731


@pytest.mark.parametrize("name, layers", [("mixtral", [0, 1]), ("qwen3", [1, 2]), ("qwen2", [0, 1]),
                                          ("olmoe", [0, 1]), ("deepseek", [1, 2, 3]), ("gptoss", [0, 1])])
def test_the_policy_finds_the_experts(name, layers):
    model = build(name)
    policy = policy_for(model)
    assert policy is not None and policy.experts == tuple(f"model.layers.{i}.mlp" for i in layers)
    found = expert_modules(model, policy)
    assert [e.gate_up_proj.shape[0] for _, _, e in found] == [4] * len(layers)
    policy.check(model)


def test_a_prepared_model_computes_what_hf_computes():
    plain, prepared = build("mixtral"), build("mixtral")
    count_router_loss(prepared, policy_for(prepared))
    assert sum(isinstance(m, RouterLoss) for m in prepared.modules()) == 2
    x = torch.randint(0, 64, (2, 16))
    a, b = plain(x, output_router_logits=True), prepared(x, output_router_logits=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.aux_loss, b.aux_loss)  # no MoEStep: HF's own


def test_inside_the_engine_hf_computes_no_loss_of_its_own(monkeypatch):
    """Under the engine's ``MoEStep`` a counted model's forward skips HF's ``load_balancing_loss_func`` (over one
    rank's rows; the routers count the whole batch's): same logits, no ``aux_loss``; the config still asks for
    the loss (``aux_coef``), and outside the engine HF computes it as before."""
    import transformers.models.mixtral.modeling_mixtral as mixtral

    from colab_kit.models.hf_moe import aux_coef
    from colab_kit.models.moe_context import MoEStep, at

    calls = []
    own = mixtral.load_balancing_loss_func
    monkeypatch.setattr(mixtral, "load_balancing_loss_func", lambda *a, **k: calls.append(1) or own(*a, **k))
    plain, prepared = build("mixtral"), build("mixtral")
    count_router_loss(prepared, policy_for(prepared))
    count_router_loss(prepared, policy_for(prepared))  # idempotent: one hook
    x = torch.randint(0, 64, (2, 16))
    with at(MoEStep()):
        inside = prepared(x)
    assert calls == [] and inside.aux_loss is None and torch.equal(inside.logits, plain(x).logits)
    assert prepared.config.output_router_logits and aux_coef(prepared) == aux_coef(plain) == 0.1
    assert len(prepared._forward_pre_hooks) == 1
    with at(MoEStep()):  # a caller that asks for HF's loss still gets it
        assert torch.equal(prepared(x, output_router_logits=True).aux_loss, plain(x).aux_loss)
    calls.clear()
    assert torch.equal(prepared(x).aux_loss, plain(x).aux_loss) and len(calls) == 2  # one process: HF's own


def test_a_counted_router_keeps_its_records_on_the_device():
    """Under the engine's ``MoEStep`` a counted router writes its layer's routing as tensors (no host read in the
    forward); ``step_layers`` reads them at the step's end into the ints and floats of the per-value reads."""
    from colab_kit.expert import records as moe_records
    from colab_kit.models.moe_context import MoEStep, at
    from tests.helpers.moe import old_records

    model = build("mixtral")
    count_router_loss(model, policy_for(model))
    steps = [MoEStep(pieces=2, grad_scale=0.5) for _ in range(2)]
    for i, step in enumerate(steps):
        with at(step):
            model(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))).logits.sum().backward()
    for step in steps:
        assert sorted(step.seen) == [0, 1]
        for seen in step.seen.values():
            assert all(isinstance(seen[k], torch.Tensor) and not seen[k].requires_grad
                       for k in ("counts", "mine", "balance", "z")), seen
    got = moe_records.step_layers(steps)
    assert got == old_records(steps)
    assert all(type(c) is int for c in got[0]["counts"] + got[0]["mine"]) and type(got[0]["balance"]) is float
    assert sum(got[0]["counts"]) == 2 * 2 * 16 * 2 and got[0]["counts"] == got[0]["mine"]


@pytest.mark.parametrize("name, kw, rule", [
    ("mixtral", dict(dp=6, ep=3), "must divide the number of experts: try ep=1 or 2"),
    ("deepseek", dict(tp=2), "multi-head latent attention (queries and keys-values through low-rank latents "
                             "shared by every head, q_a_proj / kv_a_proj_with_mqa) has no tensor plan in this "
                             "version: set tp=1 (dp=2 runs the same ranks"),
    ("olmoe", dict(dp=2, tp=2), "normalises q and k over all heads' features at once"),
    ("gptoss", dict(dp=2, sp=2), "sp=2 with GptOssForCausalLM: its attention (a learned sink per head"),
    ("gptoss", dict(tp=2), "set tp=1, sp=1 and pp=1 (dp, ep and ZeRO run it)"),
    ("qwen3", dict(tp=4, tp_mode="2d"), "mixture-of-experts layers with tp_mode='2d'"),
])
def test_bad_input_is_refused_before_any_process(name, kw, rule):
    with pytest.raises(ck.ConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        ck.boost(build(name), SGD, ck.ParallelConfig(**kw))


def test_pp_runs_when_the_loss_is_off():
    from colab_kit.engine.core import check_experts

    model = build("mixtral")
    model.config.output_router_logits = False
    check_experts(ck.ParallelConfig(dp=2, pp=2), model)  # no ConfigError: nothing couples the stages


def test_ep_on_a_dense_model_is_refused():
    import transformers as tf

    torch.manual_seed(0)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ck.ConfigError, match="has none its policy can find"):
        ck.boost(llama, SGD, ck.ParallelConfig(dp=2, ep=2))
    assert set(MODELS) == {"mixtral", "mixtral4", "qwen3", "qwen2", "olmoe", "deepseek", "gptoss"}


def test_a_load_balancing_loss_the_engine_cannot_count_is_refused():
    """Phi-MoE has no policy here: its aux loss would be dropped silently, so it is refused."""
    import transformers as tf

    cfg = tf.PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          output_router_logits=True, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    with pytest.raises(ck.ConfigError, match="set config.output_router_logits=False to train on the cross-entropy"):
        ck.boost(tf.PhimoeForCausalLM(cfg), SGD, ck.ParallelConfig(dp=2))


@pytest.mark.parametrize("what", ["model", "config"])
def test_the_estimator_prices_an_hf_mixture_of_experts_as_one(what):
    """ck.estimate reads an HF MoE model (its policy names experts) or config (routed experts) as a mixture of
    experts (``planner.moe.shape``), never as a dense model of the same widths: the same price either way, and
    its assumptions say how the experts were priced."""
    model = build("deepseek")
    a = ck.estimate(model, ck.ParallelConfig(dp=2), batch=8, seq=16)
    b = ck.estimate(model.config, ck.ParallelConfig(dp=2), batch=8, seq=16)
    assert a.model_flops == b.model_flops > 0
    assert any("mixture of experts" in x for x in (a if what == "model" else b).assumptions)
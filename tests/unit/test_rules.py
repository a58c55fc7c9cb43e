"""The rules in one place (``engine.rules``): the planner proposes nothing ``boost`` refuses, and refuses what
``boost`` refuses with the same words (tier 1, no process).

For a dense GPT, the MoE GPT, and Hugging Face Llama (grouped-query attention, 2 key/value heads), Mixtral and
DeepSeek-V3 (multi-head latent attention) built small on the meta device, every candidate of ``ck.plan`` at 8
ranks (the A100 preset, and this machine's enumeration) passes what ``boost`` asks before any process group:
``first_refusal(config)``, then ``check_policy(model, config)`` (engine/core.py). For each model a config the
engine refuses is refused by the planner's facts with the same message, and kept out of the plan. DeepSeek-V3
with its published YaRN rope (attention scaled by ``mscale**2`` more) is refused under ring and Ulysses before
any process starts, where it used to stop mid-step."""
from __future__ import annotations

import re

import pytest
import torch

import colab_kit as ck
from colab_kit.engine.checks import check_policy
from colab_kit.engine.facts import ModelFacts
from colab_kit.engine.parts import PARTS, first_refusal, part, refusals
from colab_kit.models import GPT, GPTConfig
from colab_kit.planner import EXAMPLE_CONSTANTS, enumerate_configs
from colab_kit.planner.moe.local import moe_configs
from colab_kit.planner.shape import shape_and_facts
from colab_kit.sequence.plan import scale_refusal

tf = pytest.importorskip("transformers")

P = ck.ParallelConfig
SGD = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
GPT_CFG = GPTConfig(vocab_size=64, seq_len=64, d_model=64, n_heads=4, n_layers=4)
MOE_CFG = GPTConfig(vocab_size=64, seq_len=64, d_model=64, n_heads=4, n_layers=4, n_experts=4, top_k=2)
HF = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
          max_position_embeddings=64, eos_token_id=None, pad_token_id=None, bos_token_id=None,
          tie_word_embeddings=False)
YARN = dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1, rope_theta=10000.0)  # DeepSeek-V3's published rope, scaled down


def build(name: str, **extra) -> torch.nn.Module:
    """A fresh model ``name`` on the meta device (no weights)."""
    if name in ("gpt", "gpt-moe"):
        return GPT(GPT_CFG if name == "gpt" else MOE_CFG, device="meta")
    make = {"llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**HF, num_hidden_layers=4)),
            "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
                **HF, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2)),
            "deepseek": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
                **{**HF, "num_attention_heads": 4, "num_key_value_heads": 4}, num_hidden_layers=4,
                n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1, num_experts_per_tok=2,
                n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                v_head_dim=8, **extra))}[name]
    with torch.device("meta"):
        return make()


MODELS = ("gpt", "gpt-moe", "llama", "mixtral", "deepseek")


def boost_refuses(model, config) -> str | None:
    """What ``ck.boost`` raises for ``config`` before any process group, or None: its own two calls, in order."""
    try:
        why = first_refusal(config)
        if why is not None:
            raise why
        check_policy(model, config)
    except ck.ConfigError as e:
        return str(e)
    return None


def local_configs(name: str, model) -> list:
    """This machine's candidates at 8 ranks: ``enumerate_configs`` (``moe_configs`` for the MoE GPT) over the
    facts the local plan reads (the GPT's config; a Hugging Face model's meta copy, as ``_other_model`` reads it:
    the configs come from the facts alone, the GPTConfig only says the batch's rows)."""
    if name == "gpt":
        return list(enumerate_configs(GPT_CFG, 8, 8))
    if name == "gpt-moe":
        return list(moe_configs(MOE_CFG, 8, 8))
    _, facts = shape_and_facts(model)
    return list(enumerate_configs(GPT_CFG, 8, 8, facts=facts))


def _rules_read(config) -> P:
    """``config`` less what no rule reads (precision, offload): one ``check_policy`` per distinct rest."""
    return config.replace(precision="fp32", offload="none")


@pytest.mark.parametrize("name", MODELS)
def test_every_planned_candidate_passes_what_boost_asks_before_any_process(name):
    planned = build(name)
    at_scale = [c.config for c in ck.plan(planned, 8, 16, hardware="8xA100-80GB", limit=100)]
    local = local_configs(name, planned)
    assert len(at_scale) >= 50 and len(local) >= 100, (len(at_scale), len(local))
    model = build(name)
    seen: dict = {}
    for config in at_scale + local:
        key = _rules_read(config)
        if key not in seen:
            seen[key] = boost_refuses(model, config)
        assert seen[key] is None, (config.describe(), seen[key])


REFUSED = [  # (model, a config boost refuses at 8 ranks, the rule, words of its message, what no candidate holds)
    ("gpt", P(tp=8), "tensor_sizes", "n_heads=4 not divisible by 8",
     lambda c: c.tp == 8 and c.tp_mode == "1d"),
    ("gpt", P(dp=4, pp=2, zero=3), "zero3_pipeline", "does not run ZeRO stage 3 with pipeline parallelism yet",
     lambda c: c.zero == 3 and c.pp > 1),
    ("gpt-moe", P(dp=2, tp=4, tp_mode="2d"), "moe_tokens", "mixture-of-experts layers with tp_mode='2d'",
     lambda c: c.tp_mode != "1d"),
    ("gpt-moe", P(dp=8, ep=8), "ep_experts", "must divide the number of experts: try ep=1, 2 or 4",
     lambda c: c.ep == 8),
    ("llama", P(dp=4, tp=2, sp_mode="split_gather"), "split_gather_layers", "rmsnorm",
     lambda c: c.sp_mode == "split_gather"),
    ("llama", P(dp=2, tp=4), "tensor_sizes", "n_kv_heads=2 not divisible by 4",
     lambda c: c.tp >= 4 and c.tp_mode == "1d"),
    ("mixtral", P(dp=2, tp=4, ep=2), "tensor_sizes", "n_kv_heads=2 not divisible by 4",
     lambda c: c.tp >= 4 and c.tp_mode == "1d"),
    ("deepseek", P(dp=4, tp=2, ep=2), "attention_heads", "multi-head latent attention", lambda c: c.tp > 1),
]


@pytest.mark.parametrize("name, config, rule, words, never", REFUSED,
                         ids=[f"{r[0]}: {r[1].describe()}" for r in REFUSED])
def test_what_boost_refuses_the_planner_refuses_with_the_same_words(name, config, rule, words, never):
    engine = boost_refuses(build(name), config)
    assert engine is not None and words in engine, engine
    shape, facts = shape_and_facts(build(name))  # what ck.plan and ck.estimate judge by, at a preset
    planner = first_refusal(config, facts)
    assert planner is not None and str(planner) == engine
    assert [r.name for _, r, _ in refusals(config, facts)][0] == rule
    assert not [c for c in ck.plan(build(name), 8, 16, hardware="8xA100-80GB", limit=400) if never(c.config)]
    assert not [c for c in local_configs(name, build(name)) if never(c)]
    if name in ("gpt", "gpt-moe"):  # the local enumeration judges by the config's facts: the same words
        local = ModelFacts.of(GPT_CFG if name == "gpt" else MOE_CFG, seq=64)
        assert str(first_refusal(config, local)) == engine
    priced = next(r for _, r, _ in refusals(config, facts)).priced
    if priced:  # a layout the engine cannot lower for this model: ck.estimate prices it at a preset, saying so
        est = ck.estimate(build(name), config, 16, hardware="8xA100-80GB")
        assert any(engine in a for a in est.assumptions), est.assumptions
        with pytest.raises(ck.ConfigError, match=re.escape(words)):
            ck.estimate(build(name), config, 16, hardware="this machine", constants=EXAMPLE_CONSTANTS)
    else:
        with pytest.raises(ck.ConfigError) as refused:
            ck.estimate(build(name), config, 16, hardware="8xA100-80GB")
        assert str(refused.value) == engine


def test_deepseek_v3_with_its_yarn_rope_is_refused_under_sp_before_any_process():
    """transformers scales DeepSeek-V3's attention by ``mscale**2 / sqrt(d_qk)`` under its published YaRN rope;
    ring and Ulysses scale by ``1 / sqrt(d_qk)`` and used to stop mid-step with the ConfigError of their attention
    function. Now ``boost`` refuses it in the kernel with that same message, and the plan proposes no sp for it.
    Its latent attention's unequal head widths (q/k 12, v 8) are no refusal: Ulysses and the ring carry both
    (tests/ranks/test_hf_moe.py trains it), and with the plain rope they are planned."""
    yarn = build("deepseek", rope_parameters=YARN)
    attn = yarn.model.layers[0].self_attn
    in_step = scale_refusal(attn.scaling, attn.qk_head_dim)  # what the attention function raised mid-step
    assert in_step is not None
    for config in (P(dp=4, sp=2, sp_mode="ulysses"), P(dp=2, sp=4, sp_mode="ulysses", ep=2), P(dp=4, sp=2)):
        with pytest.raises(ck.ConfigError) as refused:
            ck.boost(build("deepseek", rope_parameters=YARN), SGD, config)  # meta: no process group is reached
        assert str(refused.value) == in_step
        assert str(first_refusal(config, shape_and_facts(yarn)[1])) == in_step
    assert not [c for c in ck.plan(yarn, 8, 16, hardware="8xA100-80GB", limit=100) if c.config.sp > 1]
    plain = build("deepseek")
    facts = ModelFacts.of(plain)
    assert facts.latent and facts.head_dims == (12, 8) and facts.scale is None
    ulysses = [c.config for c in ck.plan(plain, 8, 16, hardware="8xA100-80GB", limit=100)
               if c.config.sp_mode == "ulysses"]
    assert ulysses and boost_refuses(build("deepseek"), ulysses[0]) is None


@pytest.mark.parametrize("cfg", [GPT_CFG, MOE_CFG, GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4,
                                                             n_layers=4, n_experts=4, moe_every=2, d_ff=96,
                                                             capacity_factor=1.0)])
def test_a_gpt_config_has_the_facts_of_its_model(cfg):
    """The local planner reads a GPTConfig's facts without building the GPT: they are the engine's, read off
    the model through its policy."""
    mine, engine = ModelFacts.of(cfg), ModelFacts.of(GPT(cfg, device="meta"))
    keys = ("name", "policy", "policy_error", "layers", "hidden", "heads", "kv_heads", "vocab", "attends",
            "sequence", "bidirectional_hf", "scale", "tied", "moe", "experts", "drops", "policy_experts", "aux_coef",
            "latent", "qk_norm", "sinks")
    assert {k: getattr(mine, k) for k in keys} == {k: getattr(engine, k) for k in keys}
    assert vars(mine.sizes) == vars(engine.sizes)


def test_every_part_has_a_name_and_refuses():
    names = [p.name for p in PARTS]
    assert names == ["policy", "defer_init", "dropout", "tensor", "sequence", "expert", "recompute", "pipeline_split",
                     "materialize", "placements", "broadcast", "precision", "data_parallel"]
    facts = ModelFacts.of(GPT_CFG)
    assert part("tensor").refuses(P(tp=8), facts) is not None and part("sequence").refuses(P(tp=8), facts) is None
    assert all(p.refuses(P(dp=8), facts) is None for p in PARTS)
    assert first_refusal(P(dp=2, pp=2, zero=3)) is not None  # the model unknown: what no model changes


def test_a_models_own_rmsnorm_gives_its_width():
    """A user's model whose only norms are its own RMSNorm (a weight, no ``normalized_shape``, as Hugging Face
    writes theirs) and whose policy names no row Linear: the width the tensor rules and the planner's shape read
    is the norm's, not 0 (which every tp size divides and every estimate multiplies by)."""
    import torch.nn as nn

    from colab_kit.policy import Policy
    from colab_kit.tensor import model_sizes

    class OwnRMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up = OwnRMSNorm(24), nn.Linear(24, 48)

        def forward(self, x):
            return x + self.up(self.norm(x)).view(*x.shape[:-1], 24, 2).sum(-1)

    model = nn.Module()
    model.blocks = nn.ModuleList([Block(), Block()])
    policy = Policy(name="own", blocks="blocks", layers={"blocks.*.norm": "rmsnorm", "blocks.*.up": "column"},
                    embed=lambda m, x: x, finish=lambda m, h: h)
    sizes = model_sizes(model, policy)
    assert (sizes.d_model, sizes.d_ff) == (24, 48)
    norm = nn.RMSNorm(16)  # torch's own says its width, weight or not
    from colab_kit.tensor import _width
    assert _width(norm) == 16 and _width(nn.LayerNorm(8, elementwise_affine=False)) == 8

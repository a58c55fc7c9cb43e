"""Per-op recomputation of Hugging Face mixtures of experts, measured on one rank against ``ck.estimate``.

``ck.estimate`` counts a Hugging Face MoE layer as traced off the layer (``planner.moe.shape.moe_memory``,
``memory.moe_saves``); under ``recompute="op"`` (every second matmul kept) the layer is traced again under the
engine's policy, counted on from attention's matmuls, so what the family's order keeps is what is counted:
Mixtral's router logits (q, k, v, o, the router fifth), Qwen2-MoE's shared expert's gate and down outputs and its
1-wide gate (the shared expert runs first; here 256 wide, eight times the hidden width). Measured here (fp32, 8
rows of 16 tokens, 2 blocks): Mixtral 207,492 B held under "op", estimated 207,492; Qwen2-MoE 499,332 B, estimated
499,332 (1,701,540 when its MoE layer was counted as not recomputed). A shape whose layer could not be traced
(``moe_saves=None``) falls back to ``op_keeps_router``: the router's logits where its order is Mixtral's, else the
whole layer, an upper bound. The six families in every mode: tests/ranks/test_hf_activations.py.
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck

COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
              num_hidden_layers=2)
MODES = ("none", "op")


def _config(name: str):
    import transformers as tf
    if name == "mixtral":
        return tf.MixtralConfig(**COMMON, intermediate_size=64, num_experts_per_tok=2, num_local_experts=4,
                                eos_token_id=None, pad_token_id=None, bos_token_id=None)
    return tf.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                             shared_expert_intermediate_size=256, num_experts_per_tok=2, eos_token_id=None,
                             pad_token_id=None, bos_token_id=None)


def _held(_) -> dict:
    import transformers as tf

    from colab_kit.datasets import SyntheticTokens
    tf.logging.set_verbosity_error()
    out = {}
    for name in ("mixtral", "qwen2moe"):
        for mode in MODES:
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(_config(name))
            engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(recompute=mode))
            engine.train_step(SyntheticTokens(64, 16, seed=1).batch(0, 8))
            out[name, mode] = engine.memory()["activations"]
            engine.close()
    return out


@pytest.fixture(scope="module")
def held():
    return ck.launch(_held, 1, None, timeout=300)[0]


def _estimated(name: str, mode: str) -> int:
    return ck.estimate(_config(name), ck.ParallelConfig(recompute=mode), 8, hardware="8xH100-SXM").memory["activations"]


def test_mixtral_under_op_is_estimated_as_keeping_the_router_logits(held):
    assert held["mixtral", "op"] < held["mixtral", "none"] / 3
    assert _estimated("mixtral", "op") == pytest.approx(held["mixtral", "op"], rel=0.005)
    assert _estimated("mixtral", "none") == pytest.approx(held["mixtral", "none"], rel=0.005)


def test_qwen2_moe_under_op_keeps_what_its_order_keeps(held):
    """Its shared expert (256 wide) runs before the router: gate 5th and down 7th kept, the router 8th not."""
    assert _estimated("qwen2moe", "op") == pytest.approx(held["qwen2moe", "op"], rel=0.005)
    assert _estimated("qwen2moe", "none") == pytest.approx(held["qwen2moe", "none"], rel=0.005)


def test_an_untraced_layer_falls_back_to_the_order_rule(held):
    """Without the trace (``moe_saves=None``: a layer fake tensors cannot run) Mixtral's order still keeps its
    router's logits (``op_keeps_router``), and Qwen2-MoE's is counted as not recomputed, an upper bound."""
    from dataclasses import replace

    from colab_kit.planner.moe.shape import op_keeps_router
    from colab_kit.planner.shape import ModelShape

    def untraced(name, mode):
        shape = replace(ModelShape.of(_config(name)), moe_saves=None)
        return ck.estimate(shape, ck.ParallelConfig(recompute=mode), 8, hardware="8xH100-SXM").memory["activations"]

    assert op_keeps_router(ModelShape.of(_config("mixtral")))
    assert untraced("mixtral", "op") == pytest.approx(held["mixtral", "op"], rel=0.01)
    assert not op_keeps_router(ModelShape.of(_config("qwen2moe")))
    assert held["qwen2moe", "op"] < untraced("qwen2moe", "op") <= untraced("qwen2moe", "none")

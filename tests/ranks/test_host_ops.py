"""The host floor's operator counts (``planner.cluster.host.OPS``) recounted on the engine.

One spawn of one rank trains each counted family (the built-in GPT and its mixture of experts, Hugging Face's
Llama and Mixtral) at a tiny width, in fp32 and bf16, at several depths, microbatch counts and recompute modes,
and counts the operators of its second step (``colab_kit.observe.ops.count_ops``; AdamW with ``foreach=True``,
as torch picks it for CUDA tensors); each must be what
``ops_per_step`` says for the model's ``ModelShape`` within 1% (routing makes a few operators data-dependent).
The widths do not matter: the GPU check's 125M GPT counts what its tiny twin does. A count taken for the
wrong family, or with the recompute left out, is off by far more than 1%.
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.planner.cluster.host import ops_per_step
from colab_kit.planner.shape import ModelShape

POINTS = [(1, 1, "none"), (2, 2, "none"), (2, 1, "full"), (1, 2, "op"), (2, 1, "selective")]  # blocks, m, recompute
FAMILIES = ("gpt", "gpt-moe", "llama", "mixtral")


def _build(name: str, layers: int, wide: bool = False):
    import transformers as tf

    from colab_kit.models import GPT, GPTConfig
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=96 if wide else 32, n_heads=4, n_layers=layers))
    if name == "gpt-moe":
        return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=layers, n_experts=4, top_k=2,
                             d_expert=16, aux_loss=0.01))
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=16, num_hidden_layers=layers)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_experts_per_tok=2, num_local_experts=4,
                                                  output_router_logits=True, router_aux_loss_coef=0.1,
                                                  eos_token_id=None, pad_token_id=None, bos_token_id=None))


def _count(_) -> list[dict]:
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.observe.ops import count_ops
    out = []
    runs = [(f, p, *pt, False) for f in FAMILIES for p in ("fp32", "bf16") for pt in POINTS]
    runs.append(("gpt", "bf16", 2, 1, "none", True))  # three times as wide: the same count
    for name, precision, layers, m, recompute, wide in runs:
        model = _build(name, layers, wide)
        shape = ModelShape.of(model)
        engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=3e-4, foreach=True),  # as on CUDA
                          ck.ParallelConfig(precision=precision, microbatches=m, recompute=recompute))
        data = SyntheticTokens(64, 16, seed=2)
        engine.train_step(data.batch(0, 4))
        ops = count_ops(lambda: engine.train_step(data.batch(1, 4)))["ops"]
        engine.close()
        out.append(dict(name=name, precision=precision, layers=layers, m=m, recompute=recompute, wide=wide, ops=ops,
                        want=ops_per_step(shape, layers, m, precision, recompute),
                        no_recompute=ops_per_step(shape, layers, m, precision, "none")))
    return out


@pytest.fixture(scope="module")
def counted():
    return ck.launch(_count, 1, None, timeout=300)[0]


def test_the_floor_counts_what_the_engine_dispatches(counted):
    for r in counted:
        assert r["ops"] == pytest.approx(r["want"], rel=0.01), r


def test_a_wrong_family_or_a_forgotten_recompute_is_caught(counted):
    by = {(r["name"], r["precision"], r["layers"], r["m"], r["recompute"]): r for r in counted if not r["wide"]}
    gpt, llama = by["gpt", "bf16", 2, 2, "none"], by["llama", "bf16", 2, 2, "none"]
    assert abs(gpt["ops"] - llama["want"]) > 0.05 * gpt["ops"]  # the other family's count is far off
    full = by["gpt", "fp32", 2, 1, "full"]
    assert abs(full["ops"] - full["no_recompute"]) > 0.05 * full["ops"]

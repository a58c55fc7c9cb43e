"""What a Hugging Face decoder block saves for backward, counted (``memory.saves.BlockSaves``) against its
forward traced on fake tensors (``traced_activations``: autograd's saved tensors, each storage once, equal to
the meter on the real model, tests/ranks/test_models_memory.py), one block at a time: the trace of a model of
3 blocks less that of 2. The GPT twin the at-scale estimate counted before (a gated MLP as a GPT MLP of 1.5x
its width) is off by 15-40% here, so each check rejects it. The whole model, embeddings and fp32 loss included,
against the engine's meter on several ranks: tests/ranks/test_hf_activations.py."""
from __future__ import annotations

import pytest
import torch

from colab_kit.memory.estimator import traced_activations
from colab_kit.memory.saves import BlockSaves
from colab_kit.planner.estimate import gpt_of
from colab_kit.planner.shape import ModelShape

import colab_kit as ck

transformers = pytest.importorskip("transformers")

ROWS, SEQ = 2, 16


def _config(kind: str, layers: int):
    kw = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
              pad_token_id=0)
    if kind == "qwen3":  # per-head q/k norms, a head dim (24) that is not hidden / heads (16)
        return transformers.Qwen3Config(**kw, head_dim=24)
    if kind == "qwen2":  # q, k, v biases
        return transformers.Qwen2Config(**kw)
    if kind == "mistral":
        return transformers.MistralConfig(**kw)
    return transformers.LlamaConfig(**kw)


def _traced(kind: str, layers: int, precision: str) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(kind, layers))
    return traced_activations(model, (ROWS, SEQ), torch.int64, precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "mistral"])
def test_a_block_saves_what_its_ops_keep(kind, precision):
    e, n = (4 if precision == "fp32" else 2), ROWS * SEQ
    block = _traced(kind, 3, precision) - _traced(kind, 2, precision)
    shape = ModelShape.of(_config(kind, 3), seq=SEQ)
    saves = shape.block_saves()
    assert (saves.norm, saves.gated, saves.qk_norm, saves.kv, saves.rotary) == \
        ("rms", True, "head" if kind == "qwen3" else "", saves.q // 2, True)
    assert saves.block(n, e) == block, (saves.block(n, e), block)
    old = BlockSaves.of_gpt(gpt_of(shape)).block(n, e)  # the twin: rejected
    assert abs(old - block) > 0.15 * block


def test_the_worked_example_by_hand():
    """The docstring's Llama block (h 64, q 64, kv 32, 4 heads, f 176), one token in bf16: 2,840 bytes."""
    s = BlockSaves(hidden=64, heads=4, ffn=176, vocab=96, kv_width=32, kv_heads=2, norm="rms", gated=True)
    assert BlockSaves(hidden=64, heads=4, ffn=176, vocab=96, qk_norm="full").qk_bytes(1, 2) == (4 + 2) * 128 + 8
    norms = 2 * (4 * 64 + 2 * 64 + 4)  # fp32 copy, normed, 1/rms
    inputs = 2 * 2 * 64  # the norms' outputs, the q/k/v and gate/up matmuls' input
    attn = 2 * (2 * 64 + 2 * 32) + 4 * 4  # q, out, k, v; the log-sum-exp
    assert s.block(1, 2) == norms + inputs + attn + 4 * 2 * 176 == 2840
    # per-op recomputation keeps the input, q, v, gate, down (whole under tp) and the kernel's output and lse
    assert s.op_kept(1, 2) == 2 * (64 + 64 + 32 + 176 + 64 + 64) + 16
    assert s.op_kept(1, 2, tp=2) == 2 * (64 + 64) + (2 * (64 + 32 + 176 + 64) + 16) // 2
    gpt = BlockSaves.of_gpt(ck.models.GPTConfig(d_model=64, n_heads=4, d_ff=176, vocab_size=96))
    assert gpt.block(1, 2) == 2 * (2 * 64 + 2 * 2) + 2 * 2 * 64 + 4 * 2 * 64 + 16 + 2 * 2 * 176  # 16-bit statistics


def test_the_loss_is_counted_as_its_policy_takes_it():
    """``model_activations`` adds the loss's saved tensors, outside the traced forward (the fp32 log-softmax, the
    targets, the weight): over every token for a language model's ``loss="tokens"``, one row each for a
    classifier's ``loss="classes"`` on token inputs (its logits ``[b, C]``), on one rank exactly that difference."""
    import dataclasses

    from colab_kit import ParallelConfig
    from colab_kit.memory.estimator import model_activations
    from colab_kit.policy import policy_for

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config("llama", 2))
    policy = policy_for(model)
    traced = _traced("llama", 2, "fp32")
    tokens = model_activations(model, policy, ParallelConfig(), (ROWS, SEQ), torch.int64, traced=traced)
    rows = model_activations(model, dataclasses.replace(policy, loss="classes"), ParallelConfig(), (ROWS, SEQ),
                             torch.int64, traced=traced)
    v, n = 96, ROWS * SEQ
    assert tokens == traced + 4 * n * v + 8 * n + 4
    assert tokens - rows == (4 * v + 8) * (n - ROWS)

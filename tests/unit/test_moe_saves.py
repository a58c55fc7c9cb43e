"""What a Hugging Face MoE layer saves for backward, traced off the layer (``memory.moe_saves``): the trace against
a hand count of Mixtral's layer, and against the same layer run on real CPU tensors for every family the engine
trains; the norm told apart by what it saves (``memory.saves.rms_kind``); DeepSeek-V3's latent attention and
GPT-OSS's eager attention with sinks against hand formulas (``BlockSaves.attention``). The whole models' counts
against the engine's meter: tests/ranks/test_hf_activations.py."""
from __future__ import annotations

import pytest
import torch

from colab_kit.memory.fake import saved_bytes
from colab_kit.memory.moe_saves import trace_moe_layer
from colab_kit.memory.saves import BlockSaves, rms_kind

tf = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen3", "olmoe", "qwen2", "deepseek", "gptoss")


def _meta(name: str):
    from tests.helpers import hf_moe
    cls, cfg = hf_moe.MODELS[name]
    with torch.device("meta"):
        return cls(cfg())


def test_a_mixtral_layer_traced_is_the_hand_count():
    """h 32, 4 experts of width 64, top-2 (the module docstring's worked example): the router ``4 E + 8 k + 4 + 4 k``
    a token (fp32 softmax, int64 top-k, the sum and the top-k values it divides), each of the k rows three int64
    indices, the gathered row, gate and up, the SiLU's output and the product, its fp32 weight, the expert's
    output; the experts' int32 offsets once. The MoE GPT's table (GELU experts: ``2 e R f``) undercounts it."""
    layer = _meta("mixtral").model.layers[1].mlp
    h, f, n_exp, k = 32, 64, 4, 2
    saves = trace_moe_layer(layer, h, n_exp)
    for e in (4, 2):
        router = 4 * n_exp + 8 * k + 4 + 4 * k
        per_row = 24 + e * h + 2 * e * f + 2 * e * f + 4 + e * h
        assert saves.bytes(1000, e) == 1000 * (router + k * per_row) + 4 * n_exp, e
        gelu_table = 1000 * (router + k * (24 + 3 * e * h + 2 * e * f + 4)) + 4 * n_exp
        assert saves.bytes(1000, e) > gelu_table
    with_loss = trace_moe_layer(layer, h, n_exp, aux=True)  # the engine's router: its softmax and sums kept
    assert with_loss.bytes(1000, 2) - saves.bytes(1000, 2) == 2 * 1000 * n_exp + 2 * n_exp


def _real(layer: torch.nn.Module, tokens: int, dtype) -> int:
    """``layer`` run on real CPU tensors, counted by the engine's meter (``ActivationMeter``: each storage saved
    once, parameters and here the input never)."""
    from colab_kit.measure import ActivationMeter
    layer = layer.to(dtype)
    x = torch.randn(1, tokens, 32, dtype=dtype, requires_grad=True)
    meter = ActivationMeter(exclude=[*layer.parameters(), x])
    with meter.measure():
        y = layer(x)  # kept to the end: its graph holds what was saved (GPT-OSS's returns the router's scores too)
    assert y is not None
    return meter.last


@pytest.mark.parametrize("name", FAMILIES)
def test_the_trace_on_fake_tensors_is_what_the_layer_saves_when_run(name):
    """Shapes only (``FakeTensorMode``) against the layer run on real tensors with real routing, counted by the
    engine's meter: equal to the byte, fp32 and bf16, at a token count the trace did not see (its linear fit is
    exact: no saved tensor's size depends on the routing), the same in every run (DeepSeek-V3's router drops a
    part of its graph mid-forward: what it saved is freed and its addresses taken again by new storages, which
    count)."""
    from tests.helpers import hf_moe
    torch.manual_seed(0)
    real = hf_moe.build(name).model.layers[1].mlp
    saves = trace_moe_layer(_meta(name).model.layers[1].mlp, 32, 4)
    for e, dtype in ((4, torch.float32), (2, torch.bfloat16)):
        assert saves.bytes(48, e) == _real(real, 48, dtype) == _real(real, 48, dtype), (name, e)


def test_per_op_recomputation_keeps_every_second_matmul_counted_from_the_block():
    """Under ``recompute="op"`` the layer runs under the engine's policy after attention's four matmuls (q, k, v, o):
    Mixtral's router is the 5th and kept (its ``E`` logits a token), its experts' grouped GEMMs run again; Qwen2-MoE
    runs its shared expert first (gate 5th and down 7th kept, ``S`` and ``h`` wide), its router 8th and the shared
    expert's 1-wide gate 9th (kept). Counted from an odd start, Mixtral's router is recomputed: nothing a token."""
    h, n_exp, shared = 32, 4, 32
    mixtral, qwen2 = _meta("mixtral").model.layers[1].mlp, _meta("qwen2").model.layers[1].mlp
    for e in (4, 2):
        assert trace_moe_layer(mixtral, h, n_exp, before=4).bytes(1000, e, "op") == 1000 * e * n_exp
        assert trace_moe_layer(qwen2, h, n_exp, before=4).bytes(1000, e, "op") == 1000 * e * (shared + h + 1)
        assert trace_moe_layer(mixtral, h, n_exp, before=3).bytes(1000, e, "op") == 0
    assert trace_moe_layer(mixtral, h, n_exp).op == ()  # not asked for: the walk falls back to its rule
    # under ep the engine runs GPT-OSS's experts as a loop of matmul pairs: after attention's 4 and the router,
    # each expert's 1st is the 6th, 8th, ...: its 2nd, the h-wide down output, is kept (2f where the parity flips);
    # Mixtral's experts are grouped GEMMs, which per-op does not count
    gptoss = _meta("gptoss").model.layers[1].mlp
    assert trace_moe_layer(gptoss, h, n_exp, before=4).ep_kept == h
    assert trace_moe_layer(gptoss, h, n_exp, before=3).ep_kept == 2 * 64
    assert trace_moe_layer(mixtral, h, n_exp, before=4).ep_kept == 0


def test_the_norm_is_told_apart_by_what_it_saves():
    """Llama's RMSNorm multiplies by its weight in the compute dtype (in bf16: fp32 copy, 1/rms, the normed in
    bf16), GPT-OSS's in fp32 (the normed kept in fp32)."""
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, vocab_size=64))
    gptoss = _meta("gptoss")
    assert rms_kind(llama.model.layers[0], 32) == "rms"
    assert rms_kind(gptoss.model.layers[0], 32) == "rms32"
    norm = gptoss.model.layers[0].input_layernorm
    assert saved_bytes(norm, (1, 5, 32), torch.bfloat16) == 5 * (8 * 32 + 4)
    assert BlockSaves(hidden=32, heads=4, ffn=64, vocab=64, norm="rms32").norm_bytes(5, 2) == 5 * (8 * 32 + 4)


def test_latent_and_sink_attention_by_hand():
    """DeepSeek-V3's latent attention (q rank 16, kv rank 16, rope 4, nope 8, v 8, 4 heads) and GPT-OSS's eager
    attention with sinks (q width 32, 4 heads, 17 keys: 16 positions and the sink), 128 tokens in bf16."""
    n, e, a = 128, 2, 4
    mla = BlockSaves(hidden=32, heads=a, ffn=64, vocab=64, q_width=48, latent=(16, 16, 4, 8, 8), rotary=True)
    kernel = e * n * a * 12 * 2 + e * n * a * 16 + e * n * a * 8 + 4 * n * a  # q, k, v's storage (nope + v), out, lse
    q_low = 4 * n * 16 + 4 * n + e * n * 16 + e * n * 16  # q_a_layernorm: fp32 copy, 1/rms, normed; q_b's input
    kv_low = 4 * n * 16 + 4 * n + e * n * 16 + e * n * 16  # kv_a_layernorm likewise (in bf16 its copy is kv wide)
    assert mla.attention(n, e) == kernel + q_low + kv_low
    kernel32 = 4 * n * a * (12 * 2 + 16 + 8) + 4 * n * a
    kv_low32 = 4 * n * (16 + 4) + 4 * n + 4 * n * 16 + 4 * n * 16  # in fp32 its copy is its input: kv_a's output
    assert mla.attention(n, 4) == kernel32 + (4 * n * 16 + 4 * n + 8 * n * 16) + kv_low32
    assert mla.rope(16, e) == 2 * 16 * 4 * e  # the tables are rope dims wide
    sinks = BlockSaves(hidden=32, heads=a, ffn=64, vocab=64, q_width=32, kv_width=16, kv_heads=2, sinks_keys=17)
    assert sinks.attention(n, e) == e * n * 32 * 4 + e * n * a * 17 + 8 * n * a


def test_what_cannot_be_traced_falls_back_to_the_table():
    """transformers' eager experts loop sizes its rows with ``nonzero``, which fake tensors cannot run: the shape
    keeps the MoE GPT's table (``moe_saves`` None) and ``ck.estimate`` still answers; a norm other than the two
    RMSNorm kinds, or a block whose ``input_layernorm`` is no module to call, leaves the shape's default."""
    import colab_kit as ck
    from colab_kit.planner.shape import ModelShape
    cfg = tf.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
                           max_position_embeddings=16)
    cfg._experts_implementation = "eager"
    assert ModelShape.of(cfg).moe_saves is None
    assert ck.estimate(cfg, ck.ParallelConfig(), 8, hardware="8xH100-SXM").memory["activations"] > 0
    layer_norm, no_norm = torch.nn.Module(), torch.nn.Module()
    layer_norm.input_layernorm = torch.nn.LayerNorm(32)
    no_norm.input_layernorm = torch.nn.ModuleList([torch.nn.LayerNorm(32)])
    assert rms_kind(layer_norm, 32) == rms_kind(no_norm, 32) == ""

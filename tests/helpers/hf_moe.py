"""The Hugging Face mixture-of-experts models the HF MoE tests train (4 experts each, hidden 32, vocab 64), and
their one-process reference: plain torch on the HF model, HF's own load-balancing loss."""
from __future__ import annotations

import torch
import transformers as tf

from colab_kit.engine.loss import lm_loss
from tests.helpers.moe import BATCH, OPTIMIZERS, STEPS, data, microbatch_rows
from tests.helpers.references import one_process

__all__ = ["MODELS", "build", "reference"]

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=16, eos_token_id=None, pad_token_id=None,
              bos_token_id=None, tie_word_embeddings=False)
LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.1)
MODELS = {  # name: (model class, config), 4 experts each
    "mixtral": (tf.MixtralForCausalLM, lambda: tf.MixtralConfig(**COMMON, **LOSS, num_hidden_layers=2,
                                                                 num_local_experts=4)),
    # four layers: one per stage of a zb-v pipeline (pp=2, chunks=2)
    "mixtral4": (tf.MixtralForCausalLM, lambda: tf.MixtralConfig(**COMMON, **LOSS, num_hidden_layers=4,
                                                                  num_local_experts=4)),
    # a dense first layer (mlp_only_layers), top-k weights not renormalised
    "qwen3": (tf.Qwen3MoeForCausalLM, lambda: tf.Qwen3MoeConfig(**COMMON, **LOSS, num_hidden_layers=3, num_experts=4,
                                                                 moe_intermediate_size=32, mlp_only_layers=[0])),
    # a gated shared expert beside the routed ones
    "qwen2": (tf.Qwen2MoeForCausalLM, lambda: tf.Qwen2MoeConfig(**COMMON, **LOSS, num_hidden_layers=2, num_experts=4,
                                                                 moe_intermediate_size=32,
                                                                 shared_expert_intermediate_size=32)),
    "olmoe": (tf.OlmoeForCausalLM, lambda: tf.OlmoeConfig(**COMMON, **LOSS, num_hidden_layers=2, num_experts=4)),
    # a dense first layer, shared experts, group-limited sigmoid routing, MLA attention (query and key heads 12 wide,
    # value heads 8: ring and Ulysses carry both widths; every head its own keys, as MLA has no grouped heads:
    # transformers' DeepSeek-V3 fails on q/k widths other than 8 with 2 key-value heads); no load-balancing loss
    "deepseek": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, num_hidden_layers=4, n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1,
        n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8)),
    # transposed experts with biases, gate and up interleaved, a clamped SwiGLU; attention sinks, sliding windows
    "gptoss": (tf.GptOssForCausalLM, lambda: tf.GptOssConfig(**COMMON, **LOSS, num_hidden_layers=2, num_local_experts=4,
                                                             head_dim=8, sliding_window=8)),
}

def build(name: str) -> torch.nn.Module:
    """Model ``name`` with the weights of seed 0, as every rank and the reference build it."""
    cls, cfg = MODELS[name]
    torch.manual_seed(0)
    return cls(cfg())


def reference(name: str, opt: str, microbatches: int = 1, dp: int = 1, aux: bool = True):
    """Plain torch in one process (``references.one_process``): per microbatch ``(CE + coef * HF's aux_loss) / m``
    backward, then the step; returns the losses and the trained state dict. ``aux=False``: without the aux loss."""
    model = build(name)
    coef = getattr(model, "router_aux_loss_coef", 0.0) if aux else 0.0
    losses = one_process(model, OPTIMIZERS[opt], lambda step: data().batch(step, BATCH), STEPS, _loss(coef),
                         rows=microbatch_rows(BATCH, microbatches, dp)).losses
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_mixed(name: str, opt: str, precision: str = "bf16", dp: int = 1) -> list[float]:
    """``reference`` in the mixed-precision recipe of ``colab_kit.precision``: a 16-bit model, fp32 masters
    stepped and copied back, the loss (CE on fp32 logits + coef * HF's aux loss) in fp32; one microbatch, bf16
    (no loss scale)."""
    model = build(name)
    return one_process(model, OPTIMIZERS[opt], lambda step: data().batch(step, BATCH), STEPS,
                       _loss(getattr(model, "router_aux_loss_coef", 0.0)), precision=precision).losses


def _loss(coef: float):
    def loss(model, x, y):
        out = model(x, output_router_logits=bool(coef))
        return lm_loss(out.logits.float(), y) + (coef * out.aux_loss.float() if coef else 0.0)
    return loss

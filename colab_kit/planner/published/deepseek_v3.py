"""DeepSeek-V3's published model and training layout (arXiv 2412.19437, "DeepSeek-V3 Technical Report"), as
``ck.estimate`` takes them: the model as a transformers ``DeepseekV3Config`` (built on the meta device, nothing
downloaded), the layout as a ``ParallelConfig``, and the report's figures to compare an estimate with.

What the report gives (Sec. 3.2, 4.2, 4.1 and Table 1), and the model's ``config_671B.json`` of its repository:

- 61 layers, the first 3 dense (MLP 18,432), hidden 7,168, 128 heads of MLA (q LoRA rank 1,536, kv 512,
  q.k head 128 + 64 rope, v head 128), vocabulary 129,280, untied head;
- each MoE layer 256 routed experts of width 2,048, 1 shared, top-8 (sigmoid scores, at most 4 nodes a token);
  671B parameters, 37B active per token (the multi-token-prediction module's 14B more are not in either);
- 2,048 H800 GPUs (8 a node, NVLink, one 400 Gb/s InfiniBand NIC a GPU): 16-way pipeline (DualPipe), 64-way
  expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism; FP8 GEMMs;
- sequence 4,096, batch 15,360 sequences (after a ramp from 3,072 over the first 469B tokens);
- 180K H800 GPU hours per trillion tokens (2.664M for 14.8T tokens of pre-training).

The engine runs expert parallelism in fp32 and splits blocks evenly over stages, so this layout is priced with
``precision="bf16"`` and ``uneven_stages=True`` at the ``8xH800-SXM`` preset; its assumptions say so. The
microbatch size is not published: one sequence per microbatch (120 a step) is taken.

    >>> config, batch = layout()
    >>> config.world_size, config.ep, config.dp // config.ep, batch
    (2048, 64, 2, 15360)
"""
from __future__ import annotations

from ...config import ParallelConfig

__all__ = ["model_config", "layout", "REPORTED"]

REPORTED = {"total_params": 671e9, "active_params": 37e9, "gpus": 2048, "gpu_hours_per_trillion_tokens": 180e3,
            "seq": 4096, "batch": 15360,
            "source": "DeepSeek-V3 Technical Report, arXiv 2412.19437 (Sec. 3.2, 4.2, Table 1)"}
"""The report's figures."""


def model_config():
    """DeepSeek-V3 as a transformers ``DeepseekV3Config`` of the published sizes (no weights)."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                            n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3,
                            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                            v_head_dim=128, n_group=8, topk_group=4, max_position_embeddings=4096,
                            tie_word_embeddings=False)


def layout(recompute: str = "none", schedule: str = "1f1b") -> tuple[ParallelConfig, int]:
    """``(ParallelConfig, global batch)`` of the published run: pp=16 x dp=128 (ep=64 folded over it, edp=2),
    ZeRO-1, bf16, 120 microbatches of one sequence."""
    return ParallelConfig(dp=128, pp=16, ep=64, zero=1, precision="bf16", microbatches=120, schedule=schedule,
                          recompute=recompute), 15360

"""``ck.plan`` at scale proposes each config once: with sequence parallelism over ring or Ulysses, 1D's
split_gather entry would give the same configs a second time (the 1T plan once listed one twice)."""
from __future__ import annotations

import colab_kit as ck
from colab_kit.models import GPTConfig


def test_every_candidate_is_a_different_config():
    cfg = GPTConfig(vocab_size=51200, seq_len=4096, d_model=4096, n_heads=32, n_layers=32)
    cands = ck.plan(cfg, 256, batch=256, precision="bf16", hardware="8xH100-SXM", limit=200)
    described = [c.config.describe() for c in cands]
    assert any(c.config.sp > 1 for c in cands)  # the case that made twins is there
    assert len(described) == len(set(described)), [d for d in described if described.count(d) > 1][:3]

"""``ck.plan``'s arguments refused before anything is priced, each with the rule and a value that works
(before: a negative number of GPUs' memory, a TypeError from inside the search, an IndexError for limit=-1,
restrict keys silently ignored, tp=3 blamed on memory)."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.models import GPTConfig

GPT7B = GPTConfig(vocab_size=50304, seq_len=2048, d_model=4096, n_heads=32, n_layers=32, d_ff=16384)


@pytest.mark.parametrize("kwargs, words", [
    (dict(restrict={"tensor": 2}), "'tensor' is no ParallelConfig field"),
    (dict(restrict={"microbatch": 4}), "(did you mean 'microbatches'?)"),
    (dict(memory_per_rank=-1), "memory_per_rank must be a number of bytes > 0"),
    (dict(memory_per_rank="80GB"), "memory_per_rank must be a number of bytes > 0"),
    (dict(memory_per_rank=80), "memory_per_rank=80 is in bytes: 80 GiB is 80 * 2**30"),
    (dict(limit=-1), "limit must be a whole number of candidates >= 1"),
    (dict(limit=0), "limit must be a whole number of candidates >= 1"),
    (dict(optimizer="lion"), "unknown optimizer 'lion': choose one of adamw"),
    (dict(precision="fp8"), "precision='fp8' is not one the engine trains in"),
    (dict(seq=0), "seq must be a whole number of tokens >= 1"),
    (dict(restrict={"tp": 3}), "tp=3 does not divide each of the 32 heads, the width 4096 and the 64 GPUs: tp one of 1, 2, 4"),
    (dict(restrict={"pp": (5, 7)}), "pp=5, 7 does not divide each of the 32 layers and the 64 GPUs"),
])
def test_plan_refuses_each_argument_with_what_works(kwargs, words):
    with pytest.raises(ck.ConfigError) as info:
        ck.plan(GPT7B, 64, 512, hardware="8xA100-80GB", **kwargs)
    assert words in str(info.value), str(info.value)


def test_a_restrict_that_fits_still_plans():
    cands = ck.plan(GPT7B, 64, 512, hardware="8xA100-80GB", restrict={"tp": 8, "microbatches": (4, 8)}, limit=3)
    assert cands and all(c.config.tp == 8 and c.config.microbatches in (4, 8) for c in cands)


def test_a_plan_no_config_runs_is_refused_before_the_machine_is_measured(monkeypatch):
    """``ck.plan`` on this machine measures its constants by spawning ranks (seconds): a model no config of the
    ranks can run is refused first (before: 12-21 s of measuring, then the refusal). Both paths: a GPTConfig and
    a model of the user's own."""
    import colab_kit.planner as planner
    from colab_kit.models import ViT, ViTConfig

    def measured(*a, **kw):
        raise AssertionError("the constants were measured before the refusal")

    monkeypatch.setattr(planner, "constants", measured)
    with pytest.raises(ck.ConfigError, match="no configuration of 7 ranks runs this model with a global batch of 16"):
        ck.plan(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2), 7, 16)
    with pytest.raises(ck.ConfigError, match="no configuration of 7 ranks runs ViT with a global batch of 16"):
        ck.plan(ViT(ViTConfig(image_size=8, patch_size=4, channels=1, num_classes=10, d_model=32, n_heads=4,
                              n_layers=2)), 7, 16)

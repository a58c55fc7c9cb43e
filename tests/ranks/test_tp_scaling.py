"""``planner.cluster.tp_traffic.block_wire_bytes``, the planned traffic of a block under each tensor mode, against what
the engine's layers send (``tensor.inspect.LayerTraffic`` on the four Linears of block 0, one real step) in
every mode on 4 and 8 ranks; and the paper's point it is drawn for: past a few ranks, 2D, 2.5D and 3D send
less than 1D, and 3D least."""
from __future__ import annotations

import pytest

import colab_kit as ck
from colab_kit.models import GPTConfig
from colab_kit.planner.cluster.tp_traffic import block_wire_bytes, mode_sizes

MODEL = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_heads=8, n_layers=2)
BATCH = 16
CONFIGS = ["dp=2 tp=4", "dp=2 tp=4 tp_mode=2d", "tp=8 tp_mode=2.5d tp_depth=2", "tp=8 tp_mode=3d"]


def _measure(configs, model_cfg=MODEL, batch=BATCH):
    import torch

    import colab_kit as ck
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.models import GPT
    from colab_kit.tensor.inspect import LayerTraffic

    out = {}
    for words in configs:
        cfg = ck.ParallelConfig.parse(words)
        engine = ck.boost(GPT(model_cfg), lambda ps: torch.optim.SGD(ps, lr=0.1), cfg)
        block = engine.module.blocks[0]
        taps = [LayerTraffic(m, engine.mesh) for m in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2)]
        engine.train_step(SyntheticTokens(model_cfg.vocab_size, model_cfg.seq_len).batch(0, batch))
        out[words] = sum(t.wire["forward"] + t.wire["backward"] for t in taps)
        for t in taps:
            t.remove()
        engine.close()
    return out


@pytest.fixture(scope="module")
def measured():
    return ck.launch(_measure, 8, CONFIGS)


def test_planned_block_traffic_is_what_the_engine_sends_in_every_mode(measured):
    for words in CONFIGS:
        cfg = ck.ParallelConfig.parse(words)
        rows = BATCH // cfg.dp * MODEL.seq_len
        planned = block_wire_bytes(MODEL, cfg.tp_mode, cfg.tp, rows, depth=cfg.tp_depth)
        got = {rank[words] for rank in measured}
        assert got == {planned}, (words, got, planned)  # every rank of the group sends the same
        others = [m for m in ("1d", "2d", "2.5d", "3d") if m != cfg.tp_mode and mode_sizes(m, cfg.tp, 2)]
        assert all(block_wire_bytes(MODEL, m, cfg.tp, rows) != planned for m in others)  # another mode's count fails


def test_past_a_few_ranks_2d_25d_and_3d_send_less_than_1d():
    cfg = GPTConfig(vocab_size=256, seq_len=2048, d_model=1024, n_heads=16, n_layers=1)
    rows = 8 * 2048
    for p in (64, 512):
        one = block_wire_bytes(cfg, "1d", p, rows)
        cube = block_wire_bytes(cfg, "3d", p, rows)
        assert cube < one / 4, (p, cube, one)
    assert block_wire_bytes(cfg, "2d", 64, rows) < block_wire_bytes(cfg, "1d", 64, rows)
    assert block_wire_bytes(cfg, "2.5d", 512, rows) < block_wire_bytes(cfg, "2d", 256, rows) * 2
    assert block_wire_bytes(cfg, "3d", 512, rows) < block_wire_bytes(cfg, "3d", 64, rows)  # shrinks as p grows
    assert block_wire_bytes(cfg, "1d", 512, rows) > block_wire_bytes(cfg, "1d", 64, rows)  # 1D does not
    with pytest.raises(ValueError, match=r"tp_mode='3d' cannot run on 12 tensor ranks: it takes a cube"):
        block_wire_bytes(cfg, "3d", 12, rows)


def test_the_figure_draws_each_mode_on_the_rank_counts_it_takes_and_says_planned():
    from colab_kit import viz
    cfg = GPTConfig(vocab_size=256, seq_len=2048, d_model=1024, n_heads=16, n_layers=1)
    fig = viz.tp_scaling_figure(cfg, rows=8 * 2048)
    lines = {t.name: (list(t.x), list(t.y)) for t in fig.data}
    assert lines["3d"][0] == [8, 27, 64, 216, 512] and lines["2d"][0] == [4, 16, 64, 256]
    assert lines["2.5d (depth 2)"][0] == [8, 32, 128, 512] and len(lines["1d"][0]) == 10
    assert lines["3d"][1][-1] == block_wire_bytes(cfg, "3d", 512, 8 * 2048) / 2 ** 20
    assert fig.layout.title.text.startswith("Planned (the cost model, not run)")

"""Cost, tested like correctness: each tensor mode's collectives per transformer block and step
equal ``ck.tensor.block_collectives`` (Megatron's 4 all-reduces in 1D; one SUMMA / one 3D matmul
for the fused q, k, v projection, not three). Counted from the engine's comm records as the
difference between a 4-layer and a 2-layer GPT, so embeddings, head, loss and the once-per-step
gradient sums cancel out. All configurations run in one spawn of 8 ranks."""
from __future__ import annotations

from collections import Counter

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from colab_kit.tensor import block_collectives

CONFIGS = [dict(dp=2, tp=4, tp_mode="1d"), dict(dp=2, tp=4, tp_mode="2d"),
           dict(tp=8, tp_mode="2.5d", tp_depth=2), dict(tp=8, tp_mode="3d")]


def _count(cfg_kwargs: dict, n_layers: int) -> dict:
    cfg = ck.ParallelConfig(**cfg_kwargs)
    mesh = ck.ProcessMesh(cfg)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=n_layers))
    engine = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1), cfg, mesh=mesh)
    engine.train_step(SyntheticTokens(64, 8).batch(0, 8))
    ops = Counter(r["op"] for r in engine.comm(last_step=True)
                  if r["axis"].startswith("tp") and r["tag"] != "to_dense")
    return dict(ops)


def _per_block():
    out = {}
    for kw in CONFIGS:
        two, four = _count(kw, 2), _count(kw, 4)
        out[ck.ParallelConfig(**kw).describe()] = {
            op: (four.get(op, 0) - two.get(op, 0)) / 2 for op in set(two) | set(four)}
    return out


def test_collectives_per_block_match_each_modes_formula():
    measured = ck.launch(_per_block, 8, timeout=600)[0]
    for kw in CONFIGS:
        cfg = ck.ParallelConfig(**kw)
        got = {op: n for op, n in measured[cfg.describe()].items() if n}
        assert got == block_collectives(cfg), (cfg.describe(), got)
    assert measured[ck.ParallelConfig(**CONFIGS[0]).describe()] .get("all_reduce") == 4  # Megatron's count


def _cross_entropy_traffic():
    from colab_kit.tensor.cross_entropy import vocab_parallel_cross_entropy

    mesh = ck.ProcessMesh(ck.ParallelConfig(tp=2))
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 8, requires_grad=True)  # 15 tokens, this rank's 8 of 16 vocabulary columns
    targets = torch.randint(0, 16, (3, 5))
    mark = len(mesh.log.records)
    loss = vocab_parallel_cross_entropy(logits, targets, mesh, "tp", 8 * mesh.rank("tp")).mean()
    forward = [(r.op, r.bytes) for r in mesh.log.records[mark:]]
    mark = len(mesh.log.records)
    loss.backward()
    return forward, len(mesh.log.records) - mark


def test_cross_entropy_sends_three_numbers_per_token_and_nothing_backward():
    """Megatron's vocab-parallel loss: the max, then (sum of exponentials, target logit) stacked,
    so 2 all-reduces and 3 x 4 bytes per token forward; the backward is local (softmax - onehot)."""
    for forward, backward_records in ck.launch(_cross_entropy_traffic, 2):
        assert forward == [("all_reduce", 15 * 4), ("all_reduce", 15 * 8)]
        assert backward_records == 0

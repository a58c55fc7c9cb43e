"""Layout-invariant dropout (``colab_kit.models.dropout``): each mask element is a pure function of
(seed, step, layer, global coordinates), so every split draws what one process draws.

Pure checks: the hash is the reference lowbias32 on every 32-bit input class (wrapping past 2**63
included); a block of rows, features or zigzag positions draws exactly that block of the one-process
mask; the kept share is 1 - p; steps and layers draw different masks; the gradient is the mask's.
With processes: GPT, BERT, ViT, a user's model (its own ``nn.Dropout``) and a Hugging Face GPT-2 with
every dropout at 0.1 (resid, embedding and attention probabilities) train to the losses of the same
model in one process (plain PyTorch, one forward per step) within 1e-5 under dp with microbatches,
tp 1d, split_gather, 2d, 2.5d, 3d, pp (1f1b, zb-h1 with recompute), sp ring and Ulysses (GPT-2's
attention dropout too: Ulysses on whole rows, the ring block by block), and dp x tp x pp; the one-process losses with dropout differ from those without, so a run that dropped
nothing, or drew its own masks per rank, would fail.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import BERT, GPT, BERTConfig, GPTConfig, ViT, ViTConfig
from colab_kit.models.dropout import Coordinates, Dropout, _hash32, at, current, hidden_dropout, keep_mask, layout_invariant
from colab_kit.sequence.zigzag import sequence_positions

from tests.helpers import case_id, rank0_per_world
from tests.helpers import NET_POLICY, Net, digits, mlm_batch
from tests.helpers.references import plain_training

P, STEPS, BATCH, RTOL = 0.1, 3, 8, 1e-5
OPTIMIZERS = {  # AdamW at 1e-2 moves every model far enough in 3 steps that dropout changes the losses by > 1e-4
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
}


def _ref_hash(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


# --------------------------------------------------------------------------- pure
def test_hash_is_lowbias32_on_every_input_class():
    vals = [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 0x12345678, 0xDEADBEEF] + \
        torch.randint(0, 2 ** 32, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    got = _hash32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [_ref_hash(v) for v in vals]


def test_the_int32_fast_path_draws_the_same_bits():
    from colab_kit.models.dropout import _hash32_lanes
    v = torch.randint(0, 2 ** 32, (500,), generator=torch.Generator().manual_seed(1))
    signed = torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)
    assert torch.equal(_hash32_lanes(signed).long() % 2 ** 32, _hash32(v))
    idx = torch.arange(0, 2 ** 31 - 1, 9973)
    assert torch.equal(keep_mask(idx.to(torch.int32), 0.3, 5, 2, 1), keep_mask(idx, 0.3, 5, 2, 1))
    big = torch.tensor([5, 2 ** 32 + 5, 2 ** 40 + 5])  # past 2^32 the high word is mixed in: three masks
    hashes = [keep_mask(big, 0.5, 0, s, 0) for s in range(64)]
    assert not torch.equal(torch.stack(hashes)[:, 0], torch.stack(hashes)[:, 1])


def test_keeps_one_minus_p_and_steps_layers_differ():
    idx = torch.arange(200_000, dtype=torch.int32)
    keep = keep_mask(idx, 0.1, 0, 0, 0)
    assert abs(keep.float().mean().item() - 0.9) < 0.005
    assert (keep != keep_mask(idx, 0.1, 0, 1, 0)).any() and (keep != keep_mask(idx, 0.1, 0, 0, 1)).any()
    assert (keep != keep_mask(idx, 0.1, 1, 0, 0)).any()
    assert torch.equal(keep, keep_mask(idx, 0.1, 0, 0, 0))  # a pure function


def test_a_block_of_the_tensor_draws_that_block_of_the_mask():
    """Rows 2..3 of 4 (dp), features 4..7 of 8 (a 2D grid column), zigzag positions of sp=2's rank 1:
    each local draw is the slice of the one-process draw."""
    x = torch.ones(4, 8, 8)
    full = hidden_dropout(x, 0.5, 3, 7, 2)
    rows, feats = torch.arange(2, 4), (1, 2)
    pos = sequence_positions(1, 2, 8, "zigzag")
    where = Coordinates(7, rows, positions=lambda t: (sequence_positions(1, 2, t * 2, "zigzag"), t * 2),
                        features=feats)
    local = hidden_dropout(torch.ones(2, 4, 4), 0.5, 3, 7, 2, where)
    assert torch.equal(local, full[2:4][:, pos][:, :, 4:8])
    assert not torch.equal(local, full[0:2][:, pos][:, :, 4:8])  # another block's mask differs
    with pytest.raises(RuntimeError, match=r"got 3 rows where the engine's microbatch has 2"):
        hidden_dropout(torch.ones(3, 4, 4), 0.5, 3, 7, 2, where)


def test_module_counts_steps_in_one_process_and_backward_uses_the_mask():
    d = Dropout(0.5)
    x = torch.ones(2, 3, 16, requires_grad=True)
    a, b = d(x), d(x)
    assert d.calls == 2 and not torch.equal(a, b)  # one training forward = one step
    a.sum().backward()
    assert torch.equal(x.grad, a.detach())  # d(x*mask*2)/dx = mask*2
    d.eval()
    assert d(x) is x and d.calls == 2


def test_layout_invariant_numbers_every_dropout_once():
    m = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, dropout=0.1))
    layers = [d.layer for d in m.modules() if isinstance(d, Dropout)]
    assert layers == list(range(4))
    layout_invariant(m)
    assert [d.layer for d in m.modules() if isinstance(d, Dropout)] == layers
    net = _net()
    assert [type(d) for d in net.modules() if isinstance(d, nn.Dropout)] == [nn.Dropout] * 4
    layout_invariant(net)
    assert [(type(d), d.layer) for d in net.modules() if isinstance(d, nn.Dropout)] == [(Dropout, i) for i in range(4)]


# --------------------------------------------------------------------------- models with dropout 0.1
GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, dropout=P)
BERT_CFG = BERTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, dropout=P)
VIT_CFG = ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=8, d_model=32, n_heads=4, n_layers=4,
                    dropout=P)  # 8 classes: they split over 3D's cube


def _net(p=P):
    net = Net()  # a user's model: nn.Dropout after each feed-forward, as they would write it
    for layer in net.layers:
        layer.ff.append(nn.Dropout(p))
    return net


def _gpt2(p=P):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4, resid_pdrop=p,
                                  embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def make(name, p=P):
    import dataclasses
    if name == "gpt":
        return GPT(dataclasses.replace(GPT_CFG, dropout=p))
    if name == "bert":
        return BERT(dataclasses.replace(BERT_CFG, dropout=p))
    if name == "vit":
        return ViT(dataclasses.replace(VIT_CFG, dropout=p))
    return _net(p) if name == "net" else _gpt2(p)


def batch(name, step):
    if name == "bert":
        return mlm_batch(step)
    if name == "vit":
        x, y = digits()
        keep = (y < 8).nonzero().flatten()[step * BATCH:(step + 1) * BATCH]
        return x[keep], y[keep]
    return SyntheticTokens(64, 16, seed=1).batch(step, BATCH)


def _logits(name, out):
    return out.logits if name == "gpt2" else out


@functools.lru_cache(maxsize=None)
def reference(name, opt, p=P):
    """Plain PyTorch in one process; the user's and Hugging Face's nn.Dropout made layout-invariant."""
    return plain_training(layout_invariant(make(name, p)), OPTIMIZERS[opt], lambda s: batch(name, s), STEPS,
                          lambda out: _logits(name, out))


def _train(cases):
    out = {}
    for name, kw, opts in cases:
        for opt in opts:
            engine = ck.boost(make(name), OPTIMIZERS[opt], ck.ParallelConfig(**kw),
                              policy=NET_POLICY if name == "net" else None)
            out[name, tuple(sorted(kw.items())), opt] = [engine.train_step(batch(name, s)) for s in range(STEPS)]
            engine.close()
    return out


ADAM, BOTH = ("adamw",), ("adamw", "sgd")  # SGD sees a gradient off by a constant factor
PP, ZB = dict(pp=2, microbatches=2, schedule="1f1b"), dict(pp=2, microbatches=2, schedule="zb-h1", recompute=True)
CASES = {
    2: [(m, dict(dp=2, microbatches=2), ADAM) for m in ("gpt", "bert", "vit", "net", "gpt2")]
       + [(m, dict(tp=2), BOTH) for m in ("gpt", "bert", "net", "gpt2")]
       + [(m, PP, ADAM) for m in ("gpt", "vit", "gpt2")] + [(m, ZB, ADAM) for m in ("bert", "net", "gpt2")]
       + [("gpt", dict(tp=2, sp_mode="split_gather"), ADAM), ("net", dict(sp=2, sp_mode="ring"), ADAM),
          ("bert", dict(sp=2, sp_mode="ring"), ADAM), ("gpt", dict(sp=2, sp_mode="ulysses"), ADAM),
          ("gpt2", dict(sp=2, sp_mode="ulysses"), ADAM), ("gpt2", dict(sp=2, sp_mode="ring"), BOTH)],
    4: [(m, dict(tp=4, tp_mode="2d", microbatches=2), ADAM) for m in ("gpt", "vit", "gpt2")],
    8: [("vit", dict(tp=8, tp_mode="3d"), ADAM), ("vit", dict(tp=8, tp_mode="2.5d", tp_depth=2), ADAM),
        ("gpt2", dict(dp=2, tp=2, pp=2, microbatches=2), ADAM), ("gpt", dict(dp=2, tp=2, sp=2), ADAM),
        ("gpt2", dict(dp=2, tp=2, sp=2, sp_mode="ulysses"), ADAM)],
}


@pytest.fixture(scope="module")
def runs():
    return rank0_per_world(_train, CASES)


@pytest.mark.parametrize("case", [(w, *c) for w, cs in CASES.items() for c in cs],
                         ids=lambda c: case_id(c, 1))
def test_dropout_trains_like_one_process(runs, case):
    _, name, kw, opts = case
    for opt in opts:
        got, want = runs[name, tuple(sorted(kw.items())), opt], reference(name, opt)
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want, strict=True)), (opt, got, want)
        if opt == "adamw":  # the masks do something: a run without them (or with others) would fail
            without = reference(name, opt, 0.0)
            assert max(abs(a - b) / abs(b) for a, b in zip(want, without)) > 10 * RTOL, (want, without)


def test_ring_blocks_draw_the_whole_sequence_mask():
    """Pure: the ring's blocks of (query chunk, key chunk) are the blocks of the whole mask."""
    from colab_kit.models.dropout import attention_keep
    c = Coordinates(3, torch.arange(2, 4), heads=(1, 2), batch=4)
    whole = attention_keep(c, 3, 0.5, 2, 0, 2, 2, torch.arange(8), torch.arange(8), 8, "cpu")
    block = attention_keep(c, 3, 0.5, 2, 0, 2, 2, torch.arange(2, 4), torch.arange(6, 8), 8, "cpu")
    assert torch.equal(block, whole[:, :, 2:4, 6:8]) and not torch.equal(block, whole[:, :, 0:2, 6:8])


def test_coordinates_are_held_per_context_and_nest():
    """The coordinates live in a ContextVar: ``at`` nests and gives back what was set before, even when the
    block raises; another thread starts with none of this one's."""
    import threading

    outer, inner, seen = Coordinates(1), Coordinates(2), []
    assert current() is None
    with at(outer):
        with pytest.raises(RuntimeError):
            with at(inner):
                assert current() is inner
                raise RuntimeError
        assert current() is outer
        thread = threading.Thread(target=lambda: seen.append(current()))
        thread.start()
        thread.join()
    assert current() is None and seen == [None]

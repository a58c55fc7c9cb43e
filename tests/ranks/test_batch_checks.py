"""A batch is checked before a step splits it (``colab_kit/engine/batch.py``): what torch refuses in one
process is refused under the engine too, with the rule and what would work. Under tp=2 (here) the
vocabulary-parallel embedding and loss would otherwise train on ids no rank owns, and on -1 targets as class 0,
with no error. Ranks handed different batches (``colab_kit/engine/agree.py``) are refused at the first step and
the first evaluation, on every rank. One spawn of 2 ranks; every refusal the same on both."""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def _batch():
    x, y = SyntheticTokens(64, 16, seed=1).batch(0, 4)
    return x.clone(), y.clone()


def _refusals():
    torch.manual_seed(0)
    engine = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(tp=2))
    cases = {}
    x, y = _batch()
    y[0, 5] = -1  # nanoGPT's ignore
    cases["minus one"] = (x, y)
    x, y = _batch()
    y[0, 5] = 64
    cases["past the classes"] = (x, y)
    x, y = _batch()
    cases["float targets"] = (x, y.float())
    x, y = _batch()
    x[1, 2] = 200
    cases["id past the vocabulary"] = (x, y)
    x, y = _batch()
    cases["a tensor"] = x
    cases["short targets"] = (x, y[:, :8])
    cases["fewer rows"] = (x, y[:2])
    out = {}
    for name, batch in cases.items():
        try:
            engine.train_step(batch)
            out[name] = "trained"
        except ValueError as e:
            out[name] = str(e)
    x, y = _batch()
    y[:, :4] = -100  # ignored, as torch's cross_entropy ignores it
    out["ignored"] = engine.evaluate((x, y))
    out["ignored step"] = engine.train_step((x, y))  # the same loss, then a step: -100 passes the checks
    y[0, 5] = -1
    try:
        engine.evaluate((x, y))
        out["evaluate minus one"] = "evaluated"
    except ValueError as e:
        out["evaluate minus one"] = str(e)
    engine.close()
    out.update(_agreements())
    return out


def _gathers(engine, fn):
    """``fn()``'s result and the all-gathers ``agree_on_batch`` ran inside it, counted where it calls torch."""
    from colab_kit.engine import agree

    calls = []
    real = agree._gather

    def counted(out, mine):
        calls.append(mine.numel())
        return real(out, mine)

    agree._gather = counted
    try:
        try:
            value = fn()
        except ValueError as e:
            value = str(e)
    finally:
        agree._gather = real
    return value, calls


def _agreements():
    """Each rank's own batch under dp=2 (rank 1's rows shuffled, then another seed; a refused batch is checked
    again at the next call), under tp=2 with local rows,
    a malformed batch on rank 1 only, prompts or a seed of generate; and what the check costs: one gather of FINGERPRINT numbers at the first
    step and the first evaluation, none later, none in the step's comm records."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    x, y = _batch()
    mine = (x, y) if rank == 0 else (x[[1, 0, 2, 3]], y[[1, 0, 2, 3]])  # the same rows in another order
    torch.manual_seed(0)
    dp = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(dp=2))
    out["dp shuffled"], out["dp shuffled gathers"] = _gathers(dp, lambda: dp.train_step(mine))
    out["dp same"], out["dp same gathers"] = _gathers(dp, lambda: dp.train_step((x, y)))
    out["dp same records"] = [r.op for r in dp.mesh.log.last_step()]
    out["dp later"], out["dp later gathers"] = _gathers(dp, lambda: dp.train_step((x, y)))
    other = SyntheticTokens(64, 16, seed=1 + rank).batch(0, 4)  # a per-rank seed
    out["dp eval seeded"], out["dp eval gathers"] = _gathers(dp, lambda: dp.evaluate(other))
    out["dp eval same"], out["dp eval same gathers"] = _gathers(dp, lambda: dp.evaluate((x, y)))
    out["dp eval later"], out["dp eval later gathers"] = _gathers(dp, lambda: dp.evaluate((x, y)))
    out["generate prompts"] = _gathers(dp, lambda: dp.generate(x[rank:rank + 1, :4], 2))[0]
    out["generate seeds"] = _gathers(dp, lambda: dp.generate(x[:1, :4], 2, temperature=1.0, seed=rank))[0]
    out["generate same"] = _gathers(dp, lambda: dp.generate(x[:1, :4], 2, temperature=1.0, seed=7).tolist())
    dp.close()
    torch.manual_seed(0)
    tp = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), ck.ParallelConfig(tp=2))
    rows = (x[:2], y[:2]) if rank == 0 else (x[2:], y[2:])  # a sampler over both ranks: each its half
    out["tp local halves"] = _gathers(tp, lambda: tp.train_step(rows, local=True))[0]
    malformed = (x, y) if rank == 0 else x  # rank 1 alone hands a bare tensor
    out["tp one malformed"] = _gathers(tp, lambda: tp.train_step(malformed))[0]
    tp.close()
    return out


@pytest.fixture(scope="module")
def results():
    return ck.launch(_refusals, 2)


def test_bad_batches_are_refused_before_the_step_and_ignored_targets_count_as_torchs(results):
    assert results[0] == results[1]
    r = results[0]
    assert "targets hold -1 (row 0, position 5)" in r["minus one"] and "0..63, or -100" in r["minus one"] \
        and "nanoGPT's -1 is -100 here" in r["minus one"], r["minus one"]
    assert r["past the classes"].startswith("targets hold 64 (row 0, position 5)"), r["past the classes"]
    assert "class ids as targets, got torch.float32" in r["float targets"], r["float targets"]
    assert r["id past the vocabulary"].startswith("inputs hold id 200 (row 1, position 2), outside the vocabulary "
                                                  "0..63"), r["id past the vocabulary"]
    assert r["a tensor"].startswith("a batch is a pair (inputs, targets), got a tensor of shape (4, 16)"), r["a tensor"]
    assert "one id per input token" in r["short targets"], r["short targets"]
    assert "one row per example, got inputs (4, 16) and targets (2, 16)" in r["fewer rows"], r["fewer rows"]
    torch.manual_seed(0)
    x, y = _batch()
    y[:, :4] = -100
    want = torch.nn.functional.cross_entropy(GPT(CFG)(x).flatten(0, 1), y.flatten()).item()
    assert r["ignored"] == pytest.approx(want, rel=1e-5) and r["ignored step"] == pytest.approx(want, rel=1e-5)
    assert r["evaluate minus one"].startswith("targets hold -1 (row 0, position 5)"), r["evaluate minus one"]


def test_ranks_handed_different_batches_are_refused_at_the_first_step_on_every_rank(results):
    """A loader of each rank's own (a shuffle, a per-rank seed, a sampler over every rank instead of dp) trains
    on a mixture with no error; it is refused at the first step and the first evaluation, on both ranks alike
    (a malformed batch on one rank too, where one rank would otherwise raise while the other waits). The check
    is one gather of ``FINGERPRINT`` int64s at the first accepted batch of each, none later, outside the step's
    records."""
    from colab_kit.engine.agree import FINGERPRINT

    assert results[0] == results[1]
    r = results[0]
    assert r["dp shuffled"].startswith("train_step: ranks [1] were handed a different batch from rank 0 (inputs "
                                       "and targets differ): every rank passes the same global batch"), r["dp shuffled"]
    assert "engine.loader(dataset, batch_size)" in r["dp shuffled"]
    assert isinstance(r["dp same"], float) and isinstance(r["dp later"], float)
    assert r["dp shuffled gathers"] == [FINGERPRINT] and r["dp same gathers"] == [FINGERPRINT]
    assert r["dp later gathers"] == [] and r["dp eval later gathers"] == []
    assert "all_gather" not in r["dp same records"] and r["dp same records"], r["dp same records"]
    assert r["dp eval seeded"].startswith("evaluate: ranks [1] were handed a different batch from rank 0"), \
        r["dp eval seeded"]
    assert r["dp eval gathers"] == [FINGERPRINT] and r["dp eval same gathers"] == [FINGERPRINT]  # refused: again
    assert r["dp eval same"] == r["dp eval later"] and isinstance(r["dp eval later"], float)
    assert r["generate prompts"].startswith("generate: ranks [1] were handed a different batch from rank 0 "
                                           "(prompt_ids differs): every rank passes the same prompts"), \
        r["generate prompts"]
    assert "(the settings differs)" in r["generate seeds"], r["generate seeds"]
    assert len(r["generate same"][0][0]) == 6 and r["generate same"][1] == [FINGERPRINT]  # a gather each call
    assert r["tp local halves"].startswith("train_step: ranks [1] were handed a different batch from rank 0"), \
        r["tp local halves"]
    assert "ranks of one dp coordinate (here ranks [0, 1], dp rank 0) pass the same rows" in r["tp local halves"]
    assert "DistributedSampler(num_replicas=dp, rank=dp rank)" in r["tp local halves"]
    assert r["tp one malformed"].startswith("train_step: ranks [1] passed no pair of tensors their peers could "
                                            "compare"), r["tp one malformed"]
    assert "while ranks [0] passed inputs and targets" in r["tp one malformed"]


def test_a_fingerprint_tells_batches_apart_and_is_the_same_for_equal_ones():
    """No ranks: equal batches (copies, another memory layout, summed in chunks) give one fingerprint; a
    reorder, one changed element, another dtype or shape, a bool flipped, a tensor for a pair give another."""
    from colab_kit.engine import agree

    x, y = _batch()
    base = agree.fingerprint((x, y))
    assert base.shape == (agree.FINGERPRINT,) and agree.FINGERPRINT == 13  # the count docs/training.md gives
    assert torch.equal(agree.fingerprint((x.clone(), y.clone())), base)
    assert torch.equal(agree.fingerprint((x.t().contiguous().t(), y)), base)  # strides differ, values equal
    assert torch.equal(agree.fingerprint([x, y]).narrow(0, 1, 10), base.narrow(0, 1, 10))
    changed = y.clone()
    changed[3, 15] += 1
    for other in ((x[[1, 0, 2, 3]], y[[1, 0, 2, 3]]), (x, changed), (x.int(), y), (x.reshape(8, 8), y), x,
                  (x, y.flip(1))):
        assert not torch.equal(agree.fingerprint(other), base)
    mask = torch.zeros(7, dtype=torch.bool)  # 7 bytes: read byte by byte
    flipped = mask.clone()
    flipped[6] = True
    assert not torch.equal(agree.fingerprint((mask, mask)), agree.fingerprint((mask, flipped)))


def test_floating_batches_match_within_a_rounding_and_no_further():
    """Images normalised on each rank may differ by a rounding (a mean taken in another order, on another CPU):
    still one batch. Rows reordered, a pixel changed by 1e-3, NaN in one only: another. Sums taken in chunks
    (a float64 sum's last bits depend on the grouping) still match."""
    from colab_kit.engine import agree

    torch.manual_seed(0)
    images, labels = torch.randn(16, 1, 8, 8), torch.arange(16) % 10
    base = agree.fingerprint((images, labels))

    def same(x):
        return agree._same(agree.fingerprint((x, labels)), base)

    assert same(images.clone())
    assert same(torch.nextafter(images, torch.full_like(images, 10.0)))  # every pixel one rounding up
    assert not same(images[torch.randperm(16)])
    bumped = images.clone()
    bumped[3, 0, 2, 5] += 1e-3
    assert not same(bumped)
    assert not same(images.double())
    assert not agree._same(agree.fingerprint((images, labels[torch.randperm(16)])), base)
    with_nan = images.clone()
    with_nan[0, 0, 0, 0] = float("nan")
    assert agree._same(agree.fingerprint((with_nan, labels)), agree.fingerprint((with_nan.clone(), labels)))
    assert not same(with_nan)
    big, ids = torch.randn(1000, 33), torch.randint(0, 50, (1000, 33))
    whole = agree.fingerprint((big, ids))
    real = agree._CHUNK
    agree._CHUNK = 1000  # the same sums over many chunks (and a last, short one)
    try:
        chunked = agree.fingerprint((big, ids))
    finally:
        agree._CHUNK = real
    second = slice(1 + agree.SLOT, None)
    assert agree._same(chunked, whole) and torch.equal(chunked[second], whole[second])  # the ids' sums exactly


def test_odd_tensors_fingerprint_on_every_rank_and_16_bit_floats_match_within_their_epsilon():
    """What a rank must never raise on alone (the others would wait in the gather): a byte tensor viewed at an odd
    offset, a sparse tensor, a meta tensor (marked unreadable). bf16 one rounding apart matches; a
    swap in a small float tensor, NaN on one rank only, an imaginary part changed do not."""
    from colab_kit.engine import agree

    buf = torch.arange(10, dtype=torch.uint8)
    odd = buf[1:5]  # storage offset 1, 4 elements
    assert torch.equal(agree.fingerprint((odd, odd)), agree.fingerprint((odd.clone(), odd.clone())))
    dense = torch.eye(3)
    assert agree._same(agree.fingerprint((dense.to_sparse(), buf)), agree.fingerprint((dense, buf)))
    meta = agree.fingerprint((torch.empty(4, device="meta"), buf))
    assert int(meta[1 + 1]) == agree._UNREADABLE and agree._malformed(meta)
    torch.manual_seed(0)
    x = torch.randn(2, 8).to(torch.bfloat16)
    flipped = x.clone()
    flipped[0, 3] = (flipped[0, 3].float() * (1 + 2 ** -7)).to(torch.bfloat16)
    assert not torch.equal(flipped, x)  # one bf16 rounding apart
    assert agree._same(agree.fingerprint((flipped, buf)), agree.fingerprint((x, buf)))
    small = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    swapped = small[[1, 0, 2, 3, 4, 5, 6, 7]]
    assert not agree._same(agree.fingerprint((small, buf)), agree.fingerprint((swapped, buf)))
    nan = small.clone()
    nan[2] = float("nan")
    assert agree._same(agree.fingerprint((nan, buf)), agree.fingerprint((nan.clone(), buf)))
    assert not agree._same(agree.fingerprint((nan, buf)), agree.fingerprint((small, buf)))
    inf = small.clone()
    inf[5] = float("inf")
    assert not agree._same(agree.fingerprint((inf, buf)), agree.fingerprint((small, buf)))
    z = torch.complex(small, small)
    assert not agree._same(agree.fingerprint((z, buf)), agree.fingerprint((torch.complex(small, small + 1), buf)))

"""colab_kit.datasets: text windows, token files, digits and the dp-sharded loader (pure logic, one process)."""
from __future__ import annotations

import math
import pickle
import sys
import sysconfig
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from colab_kit.config import ConfigError
from colab_kit.datasets import (ByteText, Digits, LocalBatch, ShardedLoader, SyntheticTokens, TextCorpus, TokenFile,
                                seeded)


def numbered(n: int, width: int = 3):
    """Sample i is (a row of i's, i): the targets name the sample."""
    return [(torch.full((width,), i), torch.tensor(i)) for i in range(n)]


def ids_of(batches) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def flat(batches) -> list[int]:
    return [i for rows in ids_of(batches) for i in rows]


# --- text windows -------------------------------------------------------------------------------------------

def test_windows_are_non_overlapping_and_targets_are_shifted(tmp_path):
    text = bytes(range(40, 40 + 23))  # 23 bytes: 4 windows of 5, 3 bytes left over
    (tmp_path / "a.txt").write_bytes(text)
    ds = TextCorpus(tmp_path / "a.txt", seq_len=4)
    assert len(ds) == 4 and ds.vocab_size == 256 and ds.data.dtype == torch.uint8
    for w in range(len(ds)):
        x, y = ds[w]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4,)
        assert x.tolist() == list(text[5 * w:5 * w + 4])
        assert y.tolist() == list(text[5 * w + 1:5 * w + 5])
    assert ds[-1][0].tolist() == ds[3][0].tolist()
    with pytest.raises(IndexError):
        ds[4]


def test_encode_decode_roundtrip():
    ids = TextCorpus.encode("hé, ok")
    assert ids.dtype == torch.int64 and ids.tolist()[:3] == [104, 195, 169]
    assert TextCorpus.decode(ids) == "hé, ok"
    assert TextCorpus.decode([104, 255]) == "h\ufffd"  # not UTF-8: replaced, not an error


def test_stdlib_corpus_is_deterministic_capped_and_python():
    a = TextCorpus.stdlib(seq_len=32, max_bytes=200_000)
    b = TextCorpus.stdlib(seq_len=32, max_bytes=200_000)
    assert 0 < a.data.numel() <= 200_000 and len(a) == a.data.numel() // 33
    assert torch.equal(a.data, b.data) and a.files == b.files
    root = sysconfig.get_paths()["stdlib"]
    assert all(str(f).startswith(root) and f.suffix == ".py" and "site-packages" not in f.parts for f in a.files)
    assert "def " in a.decode(a.data[:20_000])
    assert TextCorpus.stdlib(seq_len=32, max_bytes=1000).data.numel() == 1000


def test_stdlib_skips_test_suites_and_site_packages():
    ds = TextCorpus.stdlib(seq_len=32, max_bytes=None)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in ds.files)
    assert len(ds.files) > 100


def test_unigram_entropy_matches_the_byte_frequencies(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"aab" * 10)  # p = 2/3, 1/3
    ds = TextCorpus(tmp_path, seq_len=2)
    expected = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert ds.unigram_entropy() == pytest.approx(expected)
    real = TextCorpus.stdlib(seq_len=64, max_bytes=100_000).unigram_entropy()
    assert 2.0 < real < math.log(256)


def test_user_directory_is_read_recursively_with_the_suffix_filter(tmp_path):
    (tmp_path / "b.txt").write_text("BBBB")
    (tmp_path / "a.md").write_text("AAAA")
    (tmp_path / "skip.bin").write_bytes(b"XXXX")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("CCCC")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "d.txt").write_text("DDDD")
    ds = TextCorpus(tmp_path, seq_len=3)
    assert ds.decode(ds.data) == "AAAABBBBCCCC"  # sorted names, then subdirectories; no .bin, no hidden dir
    assert [f.name for f in ds.files] == ["a.md", "b.txt", "c.py"]
    only = TextCorpus([tmp_path / "sub" / "c.py", tmp_path / "skip.bin"], seq_len=3)  # named files: read as given
    assert only.decode(only.data) == "CCCCXXXX"
    txt = TextCorpus(tmp_path, seq_len=1, suffixes=(".txt",))
    assert txt.decode(txt.data) == "BBBB"
    capped = TextCorpus(tmp_path, seq_len=1, max_bytes=6)
    assert capped.decode(capped.data) == "AAAABB" and len(capped.files) == 2


def test_text_corpus_errors(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    with pytest.raises(ValueError, match="too few for one window of seq_len \\+ 1 = 5"):
        TextCorpus(tmp_path, seq_len=4)
    with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
        TextCorpus(tmp_path / "missing", seq_len=1)


def test_split_is_deterministic_and_disjoint(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(200)))
    ds = TextCorpus(tmp_path, seq_len=3)  # 50 windows
    train, val = ds.split(0.1)
    assert (len(train), len(val)) == (45, 5)
    assert train[0][0].tolist() == ds[0][0].tolist() and val[0][0].tolist() == ds[45][0].tolist()
    assert val[-1][1].tolist() == ds[49][1].tolist()
    assert train.data is ds.data  # shared, not copied
    with pytest.raises(IndexError):
        val[5]
    with pytest.raises(ValueError, match="leaves a part empty"):
        ds.split(1.0)


# --- token files -------------------------------------------------------------------------------------------

def test_token_file_roundtrip(tmp_path):
    ids = torch.randint(0, 50_000, (1000,), generator=torch.Generator().manual_seed(0))
    path = TokenFile.write(tmp_path / "train.bin", ids)
    assert path.stat().st_size == 2000  # uint16
    ds = TokenFile(path, seq_len=9, vocab_size=50_000)
    assert len(ds) == 100
    x, y = ds[7]
    assert x.dtype == torch.int64 and x.tolist() == ids[70:79].tolist() and y.tolist() == ids[71:80].tolist()
    wide = TokenFile(TokenFile.write(tmp_path / "w.bin", ids, dtype="int32"), 9, 50_000, dtype=np.int32)
    assert torch.equal(wide[7][0], x)
    blob = pickle.dumps(ds)  # carries the path, not a copy of the data (ds has its memmap open by now)
    assert ds._memmap is not None and len(blob) < 1000
    assert torch.equal(pickle.loads(blob)[7][1], y)


def test_token_file_out_of_range_is_an_error_on_read(tmp_path):
    path = TokenFile.write(tmp_path / "t.bin", [1, 2, 3, 4, 5, 900, 6, 7])
    ds = TokenFile(path, seq_len=3, vocab_size=512)
    assert ds[0][0].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="token 900 at position 5 is outside vocab_size=512"):
        ds[1]
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
        TokenFile(tmp_path / "odd.bin", seq_len=1, vocab_size=10)
    with pytest.raises(ValueError, match="do not fit uint16"):
        TokenFile.write(tmp_path / "big.bin", [70_000])


# --- digits ------------------------------------------------------------------------------------------------

def test_digits_shapes_labels_and_size():
    pytest.importorskip("sklearn")
    ds = Digits()
    image, label = ds[0]
    assert len(ds) == 1797 and image.shape == (1, 8, 8) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and int(label) == 0
    assert 0 <= float(ds.images.min()) and float(ds.images.max()) == 1.0
    assert sorted(set(ds.labels.tolist())) == list(range(10))
    big = Digits(size=16)
    assert big[5][0].shape == (1, 16, 16) and big.image_size == 16 and int(big[5][1]) == int(ds[5][1])
    assert 0 <= float(big.images.min()) and float(big.images.max()) <= 1.0
    train, val = ds.split(0.1)
    assert len(train) + len(val) == 1797 and int(val[0][1]) == int(ds[len(train)][1])


def test_digits_are_scikit_learns_read_without_importing_it():
    pytest.importorskip("sklearn")
    import subprocess
    from sklearn.datasets import load_digits as sk_load
    from colab_kit.datasets.images import load_digits
    images, labels = load_digits()
    d = sk_load()
    assert torch.equal(images, torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0)
    assert torch.equal(labels, torch.tensor(d.target)) and labels.dtype == torch.int64
    code = ("import sys, colab_kit.datasets as d; d.Digits(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out  # no rank pays scikit-learn's import


def test_digits_without_sklearn_says_how_to_install(monkeypatch):
    import importlib.util
    from colab_kit.datasets import images
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else find(name, *a))
    images._load_digits.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install scikit-learn"):
            Digits()
    finally:
        images._load_digits.cache_clear()


# --- the sharded loader ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2, 4])
def test_one_epoch_over_dp_ranks_covers_every_sample_once(dp):
    ds, b = numbered(24), 8
    per_rank = [ids_of(ShardedLoader(ds, b, dp_size=dp, dp_rank=r, seed=3)) for r in range(dp)]
    assert all(len(batches) == 3 and all(len(rows) == b // dp for rows in batches) for batches in per_rank)
    seen = [i for batches in per_rank for rows in batches for i in rows]
    assert sorted(seen) == list(range(24))  # every sample exactly once, so no two ranks share one


def test_drop_last_drops_the_tail_and_keeps_samples_unique():
    ds = numbered(21)
    ranks = [ids_of(ShardedLoader(ds, 8, dp_size=2, dp_rank=r)) for r in range(2)]
    seen = [i for batches in ranks for rows in batches for i in rows]
    assert len(seen) == 16 == len(set(seen))
    full = [ids_of(ShardedLoader(ds, 8, dp_size=2, dp_rank=r, drop_last=False)) for r in range(2)]
    assert len(full[0]) == 3 and {i for batches in full for rows in batches for i in rows} == set(range(21))


def test_rank_rows_are_the_matching_block_of_the_global_batch():
    ds, b, dp = numbered(32), 8, 4
    whole = list(ShardedLoader(ds, b, dp_size=1, dp_rank=0, seed=5))
    for r in range(dp):
        mine = list(ShardedLoader(ds, b, dp_size=dp, dp_rank=r, seed=5))
        for g, local in zip(whole, mine):
            assert isinstance(local, LocalBatch) and local.global_rows == b
            assert torch.equal(local[0], g[0][r * 2:(r + 1) * 2]) and torch.equal(local[1], g[1][r * 2:(r + 1) * 2])


def test_epoch_order_is_the_seeded_permutation_and_changes_per_epoch():
    ds = numbered(12)
    loader = ShardedLoader(ds, 4, dp_size=1, dp_rank=0, seed=7)
    epochs = [flat(loader) for _ in range(3)]  # each for-loop runs one epoch, the next one
    for e, order in enumerate(epochs):
        assert order == torch.randperm(12, generator=seeded(7, e)).tolist()
    assert epochs[0] != epochs[1] != epochs[2]
    assert flat(ShardedLoader(ds, 4, dp_size=1, dp_rank=0, shuffle=False)) == list(range(12))
    other = ShardedLoader(ds, 4, dp_size=1, dp_rank=0, seed=8)
    assert flat(other) != epochs[0]


def test_next_continues_into_the_next_epoch():
    ds = numbered(8)
    stream = ShardedLoader(ds, 4, dp_size=2, dp_rank=1)
    streamed = [next(stream)[1].tolist() for _ in range(5)] + [stream.next_batch()[1].tolist()]
    by_epoch = ShardedLoader(ds, 4, dp_size=2, dp_rank=1)
    assert streamed == ids_of(by_epoch) + ids_of(by_epoch) + ids_of(by_epoch)
    assert stream.state_dict()["epoch"] == 3 and stream.steps_per_epoch == len(stream) == 2


@pytest.mark.parametrize("stop_after", [3, 5, 6])  # mid-epoch, mid-epoch of the next, on an epoch boundary
def test_resume_from_state_dict_yields_the_same_batches(stop_after):
    ds = numbered(20)
    make = lambda: ShardedLoader(ds, 4, dp_size=2, dp_rank=1, seed=11)
    straight = make()
    expected = [straight.next_batch()[1].tolist() for _ in range(stop_after + 7)][stop_after:]
    first = make()
    for _ in range(stop_after):
        next(first)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state == {"epoch": stop_after // 5, "batch": stop_after % 5, "seed": 11, "batch_size": 4, "dp_size": 2,
                     "len": 20}
    resumed = make()
    resumed.load_state_dict(state)
    assert [resumed.next_batch()[1].tolist() for _ in range(7)] == expected
    off_by_one = make()
    off_by_one.load_state_dict({**state, "batch": (state["batch"] + 1) % 5})  # the test can tell positions apart
    assert [off_by_one.next_batch()[1].tolist() for _ in range(7)] != expected


def test_resume_on_another_dp_size_continues_at_the_same_global_sample():
    ds = numbered(16)
    saved = ShardedLoader(ds, 8, dp_size=2, dp_rank=0)
    next(saved)
    state = saved.state_dict()
    whole = ShardedLoader(ds, 8, dp_size=1, dp_rank=0)
    whole.load_state_dict(state)
    rows = next(whole)[1].tolist()
    for r in range(4):
        quarter = ShardedLoader(ds, 8, dp_size=4, dp_rank=r)
        quarter.load_state_dict(state)
        assert next(quarter)[1].tolist() == rows[2 * r:2 * r + 2]


def test_loading_a_state_of_another_batch_size_or_dataset_is_an_error():
    state = ShardedLoader(numbered(16), 8, dp_size=2, dp_rank=0).state_dict()
    with pytest.raises(ConfigError, match="saved with batch_size=8 and this loader has batch_size=4"):
        ShardedLoader(numbered(16), 4, dp_size=2, dp_rank=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="saved with len=16 and this loader has len=24"):
        ShardedLoader(numbered(24), 8, dp_size=2, dp_rank=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="position epoch=0, batch=2"):
        ShardedLoader(numbered(16), 8, dp_size=2, dp_rank=0).load_state_dict({**state, "batch": 2})


def test_bad_loader_inputs_state_the_rule_and_a_fix():
    ds = numbered(16)
    rule = "batch_size=10 does not split over dp=4: use a multiple of 4 such as 8 or 12"
    with pytest.raises(ConfigError, match=rule):
        ShardedLoader(ds, 10, dp_size=4, dp_rank=0)
    with pytest.raises(ConfigError, match="over dp=2 x microbatch_rows=2: use a multiple of 4 such as 4 or 8"):
        ShardedLoader(ds, 6, dp_size=2, dp_rank=0, microbatch_rows=2)
    with pytest.raises(ConfigError, match="batch_size=0 does not split over dp=2: use a multiple of 2 such as 2"):
        ShardedLoader(ds, 0, dp_size=2, dp_rank=0)
    with pytest.raises(ConfigError, match="dp_rank=2 is out of range for dp_size=2: use 0 .. 1"):
        ShardedLoader(ds, 8, dp_size=2, dp_rank=2)
    with pytest.raises(ConfigError, match="16 samples, fewer than one global batch of 32: use batch_size=16"):
        ShardedLoader(ds, 32, dp_size=2, dp_rank=0)
    with pytest.raises(TypeError, match="dp_rank"):
        ShardedLoader(ds, 8, dp_size=2)  # the dp rank is never guessed
    assert issubclass(ConfigError, ValueError)


def test_for_engine_reads_the_dp_axis_and_microbatches():
    engine = SimpleNamespace(config=SimpleNamespace(dp=2, microbatches=2),
                             mesh=SimpleNamespace(rank=lambda axis: {"dp": 1}[axis]))
    loader = ShardedLoader.for_engine(engine, numbered(16), 8, seed=4)
    assert (loader.dp_size, loader.dp_rank, loader.microbatch_rows, loader.seed) == (2, 1, 2, 4)
    with pytest.raises(ConfigError, match="over dp=2 x microbatch_rows=2"):
        ShardedLoader.for_engine(engine, numbered(16), 6)


def test_local_batch_is_a_pair_that_pickles():
    batch = LocalBatch(torch.zeros(2, 3), torch.ones(2), global_rows=8)
    x, y = batch
    assert isinstance(batch, tuple) and len(batch) == 2 and x.shape == (2, 3)
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, LocalBatch) and back.global_rows == 8 and torch.equal(back[1], y)


def test_loader_over_real_windows(tmp_path):
    loader = ShardedLoader(TextCorpus.stdlib(seq_len=16, max_bytes=17 * 64), 16, dp_size=2, dp_rank=0)
    x, y = next(loader)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_the_step_indexed_datasets_are_unchanged():
    x, y = SyntheticTokens(vocab_size=16, seq_len=6, strides=(1, 3), seed=0).batch(step=0, batch_size=2)
    assert x[0].tolist() == [12, 15, 2, 5, 8, 11] and y[0].tolist() == [15, 2, 5, 8, 11, 14]
    x, y = ByteText("abcdefghij" * 10, seq_len=4).batch(0, 2)
    assert bytes(x[0].tolist()).decode() == "efgh"

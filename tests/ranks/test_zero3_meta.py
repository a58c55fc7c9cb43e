"""ZeRO-3 from a model built on the meta device: no rank ever holds the whole model.

Every model the engine supports (GPT, BERT with its head tied to the token table and without, ViT, Hugging
Face GPT-2, Llama and Mixtral), built on meta and boosted under ``dp=4 zero=3`` (and ``dp=2 tp=2 zero=3``),
trains to the losses of the same model trained in one process with plain PyTorch, its dense values written by
``sharded_init.fill`` (a Hugging Face model's own ``from_config`` draws differ: that reference is refused, so
the comparison can fail).

Memory: a GPT of 92M parameters (370 MB in fp32) on each of 4 ranks, the growth of the process's peak resident
memory (``VmHWM`` after ``/proc/self/clear_refs``) during ``boost``: at most the rank's shards (parameters and
gradients, as ``engine.memory()`` reports them) plus one chunk in flight plus the largest dense tensor being
cut, a bound read from the chunk sizes, and within 5% of ``ck.memory.startup_bytes``; the same model built dense passes the bound (the bound can fail), and
its loss on a batch equals the dense build's (built once, for dp=4; that these engines train like one process
is the parity cases', on small models). A Llama of 106 MiB loaded with
``load_pretrained`` and saved with ``save_pretrained`` under ZeRO-3: neither holds the whole model either.
One spawn of 4 ranks.
"""
from __future__ import annotations

import ctypes
import functools
import gc

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from colab_kit.memory.startup import gathered_bytes, largest_tensor, startup_bytes
from colab_kit.sharded_init import fill

from tests.helpers import OPTIMIZERS, batch, make, one_process
from tests.helpers import hf_moe

STEPS = 3
PARITY = [(m, dict(dp=4, zero=3)) for m in ("gpt", "bert", "bert-untied", "vit", "gpt2", "llama", "mixtral")] + \
         [(m, dict(dp=2, tp=2, zero=3)) for m in ("gpt", "bert", "llama")]
BIG = GPTConfig(vocab_size=8192, seq_len=32, d_model=1024, n_heads=8, n_layers=6)
VOCAB = GPTConfig(vocab_size=32768, seq_len=32, d_model=128, n_heads=4, n_layers=2)


def _build(name: str) -> torch.nn.Module:
    if name == "mixtral":
        return hf_moe.build(name)
    return make(name.split("-")[0], tie=not name.endswith("untied"))


def _data(name: str):
    return lambda step: batch("gpt" if name == "mixtral" else name.split("-")[0], step)


def _loss(model, x, y):
    out = model(x)
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


@functools.lru_cache(maxsize=None)
def reference(name: str, filled: bool = True) -> list[float]:
    model = _build(name)
    if filled:
        fill(model)
    loss = hf_moe._loss(model.router_aux_loss_coef) if name == "mixtral" else _loss  # (its aux loss too)
    return one_process(model, OPTIMIZERS["adamw"], _data(name), STEPS, loss).losses


# --------------------------------------------------------------------------- on each rank
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _growth(make_engine):
    """``make_engine()``, and how far this process's peak resident memory rose above where it was before."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: a large tensor's pages go back when freed
    gc.collect()  # what an earlier engine left in reference cycles goes first
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the resident memory now
    engine = make_engine()
    return engine, _status("VmHWM") - before


def _memory(_):
    torch.manual_seed(0)
    out, data = {}, SyntheticTokens(BIG.vocab_size, BIG.seq_len, seed=1)
    for kw in (dict(dp=4, zero=3), dict(dp=2, tp=2, zero=3)):
        cfg = ck.ParallelConfig(**kw)
        engine, grew = _growth(lambda: ck.boost(GPT(BIG, device="meta"), OPTIMIZERS["adamw"], cfg))
        z, mem = engine.data_parallel, engine.memory()
        sizes = [p.numel() * 4 for p in GPT(BIG, device="meta").parameters()]
        got = dict(grew=grew, params=mem["params"], grads=mem["grads"], chunk=max(c.nbytes for c in z.chunks),
                   largest=max(sizes), whole=sum(sizes),
                   estimate=startup_bytes(BIG, cfg),
                   losses=[engine.evaluate(data.batch(0, 4))])  # the values are the dense build's (training: _parity)
        engine.close()
        del engine, z
        if not out:  # the control, once: the same model built dense grows past the bound, to the same losses
            dense, got["dense_grew"] = _growth(lambda: ck.boost(GPT(BIG), OPTIMIZERS["adamw"], cfg))
            got["dense_losses"] = [dense.evaluate(data.batch(0, 4))]
            dense.close()
            del dense
        out[tuple(sorted(kw.items()))] = got
    # a vocabulary-heavy model: the embeddings and the head are each larger than a block
    cfg = ck.ParallelConfig(dp=4, zero=3)
    engine = ck.boost(GPT(VOCAB, device="meta"), OPTIMIZERS["adamw"], cfg)
    engine.train_step(SyntheticTokens(VOCAB.vocab_size, VOCAB.seq_len, seed=1).batch(0, 4))
    z = engine.data_parallel
    out["vocab"] = dict(peak=z.peak_gathered, estimate=gathered_bytes(VOCAB, cfg), chunks=[c.nbytes for c in z.chunks],
                        records=[(r["op"], r["bytes"], r["tag"]) for r in engine.comm(last_step=True)
                                 if r["op"] == "all_gather"])
    engine.close()
    return out


def _parity(cases):
    out = {}
    for name, kw in cases:
        with torch.device("meta"):
            model = _build(name)
        engine = ck.boost(model, OPTIMIZERS["adamw"], ck.ParallelConfig(**kw))
        out[name, tuple(sorted(kw.items()))] = [engine.train_step(_data(name)(s)) for s in range(STEPS)]
        engine.close()
    return out


def _hf_files(src: str, dst: str) -> dict:
    """A Llama of 106 MiB built on meta under dp=4 zero=3: the growth of the peak resident memory around
    ``ck.load_pretrained`` of ``src`` and ``ck.save_pretrained`` into ``dst`` (files of at most 16 MiB), and the
    loss after the load."""
    engine = ck.boost(_llama(meta=True), OPTIMIZERS["adamw"], ck.ParallelConfig(dp=4, zero=3))
    x, y = SyntheticTokens(LLAMA["vocab_size"], 16, seed=1).batch(0, 4)
    _, load = _growth(lambda: ck.load_pretrained(engine, src))
    loss = engine.evaluate((x, y))
    _, save = _growth(lambda: ck.save_pretrained(engine, dst, max_shard_bytes=16 << 20))
    engine.close()
    return dict(load=load, save=save, loss=loss)


def _both(cases, src, dst):
    return dict(memory=_memory(None), files=_hf_files(src, dst), parity=_parity(cases))


LLAMA = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _llama(meta: bool = False):
    import transformers
    with torch.device("meta" if meta else "cpu"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A pretrained Llama written by transformers (106 MiB), its loss on one batch, and where the ranks save."""
    root = tmp_path_factory.mktemp("zero3-files")
    model = fill(_llama())
    model.save_pretrained(root / "src")
    x, y = SyntheticTokens(LLAMA["vocab_size"], 16, seed=1).batch(0, 4)
    with torch.no_grad():
        loss = _loss(model, x, y).item()
    return dict(src=str(root / "src"), dst=str(root / "dst"), loss=loss, x=x,
                logits=model(x).logits.detach(), whole=sum(p.numel() * 4 for p in model.parameters()),
                largest=max(p.numel() * 4 for p in model.parameters()))


@pytest.fixture(scope="module")
def results(files):
    return ck.launch(_both, 4, PARITY, files["src"], files["dst"], timeout=600)


@pytest.mark.parametrize("case", PARITY, ids=lambda c: f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}")
def test_a_meta_model_under_zero3_trains_like_one_process(results, case):
    name, kw = case
    ref = reference(name)
    assert abs(ref[-1] - ref[0]) > 1e-3 * abs(ref[0])  # it did train
    for rank, res in enumerate(results):
        got = res["parity"][name, tuple(sorted(kw.items()))]
        assert got == pytest.approx(ref, rel=1e-5), (rank, got, ref)
    if name in ("gpt2", "llama", "mixtral"):  # transformers' own from_config values are another model
        assert results[0]["parity"][name, tuple(sorted(kw.items()))] != pytest.approx(reference(name, False), rel=1e-5)


def test_boost_of_a_meta_model_holds_its_shards_and_one_chunk(results):
    for rank, res in enumerate(results):
        memory = dict(res["memory"])
        memory.pop("vocab")  # (its own test below)
        dense = next(iter(memory.values()))  # the dp=4 case carries the dense build's figures
        for key, got in memory.items():
            bound = got["params"] + got["grads"] + got["chunk"] + got["largest"]
            assert 0.5 * (got["params"] + got["grads"]) < got["grew"] <= bound, (rank, key, got)
            # the estimate of start-up (ck.memory.startup_bytes) and engine.memory() agree with the measurement
            assert abs(got["grew"] - got["estimate"]) <= 0.05 * got["estimate"], (rank, key, got)
            assert abs(got["params"] + got["grads"] + 4 * largest_tensor(BIG) - got["estimate"]) <= 0.01 * got["estimate"]
            assert dense["dense_grew"] > bound and dense["dense_grew"] > got["whole"], (rank, key, dense)  # can fail
            assert got["losses"] == pytest.approx(dense["dense_losses"], rel=1e-5), (rank, key)


def test_zero3_gathers_the_embeddings_and_the_head_apart(results):
    """A vocabulary of 32,768 at d 128: the token table and the head (4.2M parameters each) are each larger than a
    block (0.2M); the step never holds both whole (the estimate ``gathered_bytes``: the embeddings and a block);
    per step the embeddings are gathered twice (forward, backward: freed between) and the tail once."""
    for rank, res in enumerate(results):
        got = res["memory"]["vocab"]
        embed, blocks, tail = got["chunks"][0], got["chunks"][1:-1], got["chunks"][-1]
        assert min(embed, tail) > max(blocks)
        assert got["peak"] == got["estimate"] == embed + max(blocks), (rank, got["peak"], got["estimate"])
        assert got["peak"] < embed + tail, rank  # what keeping the rest whole through the step held at least
        gathered = {}
        for _, nbytes, tag in got["records"]:
            gathered[tag] = gathered.get(tag, 0) + 4 * nbytes  # dp=4: each rank sends a quarter
        assert gathered["zero3 gather embed"] == 2 * embed and gathered["zero3 gather tail"] == tail, gathered


def test_load_and_save_pretrained_under_zero3_hold_no_whole_model(results, files):
    """``load_pretrained`` reads each rank's rectangles (its ZeRO-3 pieces' rows: 5-8 MiB measured); ``save_pretrained``
    assembles one tensor at a time on rank 0 into files of 16 MiB: neither grows a rank by more than two files and
    three of the largest tensor (8 MiB), against 106 MiB for the model; the loaded engine's loss is the file's model's, and
    transformers reads the saved directory back to the same logits."""
    import transformers
    for rank, res in enumerate(results):
        got = res["files"]
        assert got["loss"] == pytest.approx(files["loss"], rel=1e-5), rank
        assert 0 < got["load"] <= 2 * files["largest"] + (1 << 20), (rank, got, files["largest"])
        # a file's tensors and their serialised bytes while it is written, and the tensor being assembled: every
        # rank's pickled pieces, their unpickled copies, the whole tensor (measured on rank 0: 51 MiB)
        assert got["save"] <= 2 * (16 << 20) + 3 * files["largest"] < files["whole"], (rank, got, files["largest"])
    back = transformers.LlamaForCausalLM.from_pretrained(files["dst"])
    with torch.no_grad():
        torch.testing.assert_close(back(files["x"]).logits, files["logits"], rtol=1e-5, atol=1e-5)

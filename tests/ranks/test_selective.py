"""Selective recomputation (``recompute="selective"``, ``colab_kit.recompute.selective``): attention's core runs
again in backward; the losses are one process's, the activations fall between "none" and "full" and equal
the formula.

One spawn of 2 ranks loops every config: the built-in GPT with dropout 0.1 under dp x ZeRO-3, tp 1d,
split_gather, Ulysses, ring, pp 1f1b, zb-h1 and zb-v, and ZeRO-2 offload; a Hugging Face GPT-2 with every
dropout at 0.1 (eager attention: its core keeps scores, probabilities and masks) under dp, tp, Ulysses and
zb-h1; a Llama (sdpa, grouped-query) under tp, 1f1b and the ring. Each trains 3 steps against plain PyTorch
in this process (fp32, 1e-5 relative); the dropout makes those losses differ from the dropout-free ones by
far more than that, so a recomputation that drew other masks would fail. Per-op selective checkpointing
(``recompute="op"``, ``colab_kit.recompute.op``) trains ``OP_CASES`` in the same spawn: the GPT with dropout under
ZeRO-3, the ring and zb-h1, GPT-2 with dropout under zb-h1, a Llama under tp. Beside them, one step of the GPT
without dropout under each recompute mode measures the activations and counts the collectives; and a bf16
tp run with selective gives the losses of the same run without it. 2d, 2.5d and 3d run selective in the
parity matrix (``tests/helpers/matrix.py``).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory import activation_bytes, config_estimate
from colab_kit.models import GPT, GPTConfig
from colab_kit.models.dropout import layout_invariant
from colab_kit.recompute.selective import SelectiveCore, is_selective, recompute_attention

from tests.helpers import make_hf
from tests.helpers.references import plain_training

G = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
P, STEPS, BATCH, RTOL = 0.1, 3, 8, 1e-5
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)}
PP = dict(pp=2, microbatches=2)
CASES = [  # (model, config, optimizer)
    ("gpt", dict(dp=2, microbatches=2, zero=3), "adamw"),
    ("gpt", dict(tp=2), "sgd"),
    ("gpt", dict(tp=2, sp_mode="split_gather"), "adamw"),
    ("gpt", dict(sp=2, sp_mode="ulysses"), "adamw"),
    ("gpt", dict(sp=2, sp_mode="ring"), "sgd"),
    ("gpt", dict(**PP, schedule="1f1b"), "adamw"),
    ("gpt", dict(**PP, schedule="zb-h1"), "sgd"),
    ("gpt", dict(**PP, schedule="zb-v", chunks=2), "adamw"),
    ("gpt", dict(dp=2, zero=2, offload="cpu"), "adamw"),
    ("gpt2", dict(dp=2), "adamw"),
    ("gpt2", dict(tp=2), "sgd"),
    ("gpt2", dict(sp=2, sp_mode="ulysses"), "adamw"),
    ("gpt2", dict(**PP, schedule="zb-h1"), "adamw"),
    ("llama", dict(tp=2), "adamw"),
    ("llama", dict(**PP, schedule="1f1b"), "sgd"),
    ("llama", dict(sp=2, sp_mode="ring"), "adamw"),
]
OP_CASES = [  # under recompute="op"
    ("gpt", dict(dp=2, microbatches=2, zero=3), "adamw"),
    ("gpt", dict(sp=2, sp_mode="ring"), "sgd"),
    ("gpt", dict(**PP, schedule="zb-h1"), "sgd"),
    ("gpt2", dict(**PP, schedule="zb-h1"), "adamw"),
    ("llama", dict(tp=2), "adamw"),
]
MODES = ("none", "selective", "op", "full")
MEASURED = {"dp=2": dict(dp=2), "tp=2": dict(tp=2), "ulysses": dict(sp=2, sp_mode="ulysses"),
            "ring": dict(sp=2, sp_mode="ring")}


def make(name: str, p: float = P):
    if name == "gpt":
        return GPT(dataclasses.replace(G, dropout=p))
    return make_hf(name, p if name == "gpt2" else 0.0)


def _batch(step: int):
    return SyntheticTokens(64, 16, seed=1).batch(step, BATCH)


def _logits(out):
    return getattr(out, "logits", out)


@functools.lru_cache(maxsize=None)
def reference(name: str, opt: str, p: float = P) -> list[float]:
    """Plain PyTorch in one process, no recomputation (the dropouts layout-invariant, as the engine's)."""
    return plain_training(layout_invariant(make(name, p)), OPTIMIZERS[opt], _batch, STEPS)


def _counts(engine) -> dict:
    log = engine.comm(last_step=True)
    return {key: sum(f"{r['op']}@{r['axis']}" == key for r in log)
            for key in {f"{r['op']}@{r['axis']}" for r in log}}


def _run():
    out = {}
    for name, kw, opt in CASES:
        engine = ck.boost(make(name), OPTIMIZERS[opt], ck.ParallelConfig(recompute="selective", **kw))
        out["losses", name, str(kw)] = [engine.train_step(_batch(s)) for s in range(STEPS)]
        engine.close()
    for name, kw, opt in OP_CASES:
        engine = ck.boost(make(name), OPTIMIZERS[opt], ck.ParallelConfig(recompute="op", **kw))
        out["op losses", name, str(kw)] = [engine.train_step(_batch(s)) for s in range(STEPS)]
        engine.close()
    for label, kw in MEASURED.items():
        for mode in MODES:
            engine = ck.boost(GPT(G), OPTIMIZERS["sgd"], ck.ParallelConfig(recompute=mode, **kw))
            engine.train_step(_batch(0))
            out["memory", label, mode] = engine.memory()["activations"]
            out["comm", label, mode] = _counts(engine)
            out["estimate", label, mode] = engine.memory_estimate()["activations"]
            engine.close()
    for mode in ("none", "selective"):
        engine = ck.boost(GPT(G), OPTIMIZERS["adamw"], ck.ParallelConfig(tp=2, precision="bf16", recompute=mode))
        out["bf16", mode] = [engine.train_step(_batch(s)) for s in range(STEPS)]
        engine.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return ck.launch(_run, 2)


@pytest.mark.parametrize("name,kw,opt", CASES, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                   for n, kw, _ in CASES])
def test_selective_trains_like_one_process(runs, name, kw, opt):
    want = reference(name, opt)
    for rank, res in enumerate(runs):
        got = res["losses", name, str(kw)]
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want, strict=True)), (rank, got, want)


@pytest.mark.parametrize("name,kw,opt", OP_CASES, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                      for n, kw, _ in OP_CASES])
def test_op_trains_like_one_process(runs, name, kw, opt):
    """recompute="op": the recomputation replays the dropout masks of the first forward (the SAC contexts
    entered with the block's dropout coordinates), under ZeRO-3, the ring, zb-h1's split backward, tp."""
    want = reference(name, opt)
    for rank, res in enumerate(runs):
        got = res["op losses", name, str(kw)]
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want, strict=True)), (rank, got, want)


def test_the_dropout_changes_the_losses_by_far_more_than_the_tolerance():
    """A recomputation that drew other masks (or none) would be caught: dropout moves the losses."""
    for name in ("gpt", "gpt2"):
        with_, without = reference(name, "adamw"), reference(name, "adamw", 0.0)
        assert max(abs(a - b) / abs(b) for a, b in zip(with_, without)) > 10 * RTOL, name


def test_selective_holds_less_than_none_more_than_full_and_equals_the_formula(runs):
    """dp=2 (4 rows a rank) and tp=2 (1d, 8 rows), measured by the engine's meter: none > selective > op > full,
    and each equals ``activation_bytes`` with that mode up to one offset shared by the four modes (the
    blocks to the byte; the offset is outside them: the meter counts the token ids and targets of the rank's
    slice as the whole batch's storage, 1D's vocabulary-parallel embedding and loss save a little more), under
    1%. Selective keeps exactly ``4 N a / tp`` a block less than none (the cores' log-sum-exp): a formula
    without that term (none's), or full's, is off by far more than nothing."""
    for rank, res in enumerate(runs):
        for label, rows, tp in (("dp=2", BATCH // 2, 1), ("tp=2", BATCH, 2)):
            got = {m: res["memory", label, m] for m in MODES}
            want = {m: activation_bytes(G, rows, tp=tp, recompute=m)["held"] for m in got}
            assert got["none"] > got["selective"] > got["op"] > got["full"], (rank, label, got)
            offset = {m: got[m] - want[m] for m in got}
            assert len(set(offset.values())) == 1 and 0 <= offset["none"] < 0.01 * want["full"], (rank, label, offset)
            core = 4 * rows * G.seq_len * G.n_heads // tp
            assert got["none"] - got["selective"] == G.n_layers * core, (rank, label, got)
            for wrong in ("none", "full"):  # selective measured against another mode's formula: off
                assert got["selective"] - want[wrong] != offset["selective"]
            # op: the input, qkv's and fc1's outputs and the kernel's (output, log-sum-exp) a block
            n = rows * G.seq_len
            op_block = 4 * n * G.d_model + (16 * n * G.d_model + 4 * n * G.n_heads + 4 * n * G.d_ff) // tp
            assert got["op"] - got["full"] == G.n_layers * (op_block - 4 * n * G.d_model), (rank, label, got)


def test_the_engine_s_estimate_knows_selective(runs):
    """``engine.memory_estimate()`` and ``config_estimate`` give selective's and op's bytes, between none's and
    full's. Under the ring, op recomputes the ring's output (its kernels run inside its autograd Function), and
    the estimate that takes it out is off from the meter by full's offset to the byte."""
    for res in runs:
        est = {m: res["estimate", "dp=2", m] for m in MODES}
        assert est["none"] > est["selective"] > est["op"] > est["full"]
        ring = {m: res["memory", "ring", m] - res["estimate", "ring", m] for m in ("op", "full")}
        assert ring["op"] == ring["full"], ring
        for mode in est:
            cfg = ck.ParallelConfig(dp=2, recompute=mode)
            assert est[mode] == config_estimate(G, cfg, BATCH)["activations"] == activation_bytes(
                G, BATCH // 2, recompute=mode)["held"]


def test_selective_repeats_no_collective_full_does(runs):
    """tp: full recomputation runs attention's all-reduce again (one a block), selective none. Ulysses:
    selective recomputes between the all-to-alls, so their count is none's. The ring: selective changes
    nothing (its backward already rebuilds its blocks), so its sends, receives and activations are none's.
    op: colab_kit's collectives are c10d's in-place ops, which a saved output cannot replay: they run again as
    under full (tp: attention's all-reduce; Ulysses: the all-to-alls; the ring: its rotations)."""
    for res in runs:
        for label in ("tp=2", "ulysses", "ring"):
            assert res["comm", label, "selective"] == res["comm", label, "none"], (label, res["comm", label, "selective"])
        tp_ar = {m: res["comm", "tp=2", m].get("all_reduce@tp", 0) for m in ("none", "full")}
        assert tp_ar["full"] - tp_ar["none"] == G.n_layers
        assert res["memory", "ring", "selective"] == res["memory", "ring", "none"]
        for label in ("tp=2", "ulysses", "ring"):
            assert res["comm", label, "op"] == res["comm", label, "full"], (label, res["comm", label, "op"])
            assert res["memory", label, "none"] > res["memory", label, "op"] > res["memory", label, "full"]
        assert res["memory", "ulysses", "none"] > res["memory", "ulysses", "selective"] > res["memory", "ulysses",
                                                                                                "full"]


def test_bf16_selective_gives_the_losses_of_bf16_without(runs):
    """The recomputed core runs in bf16 as the first forward did: the same losses (the same recipe; its
    tolerance against fp32 is the precision tests')."""
    for res in runs:
        assert res["bf16", "selective"] == pytest.approx(res["bf16", "none"], rel=RTOL)


def test_selective_wraps_each_attention_core_once():
    """One process: GPT's attends become SelectiveCores (twice changes nothing), gradients are the plain model's,
    and a Hugging Face model's attention implementation is wrapped under its own name."""
    plain, sel = GPT(G), GPT(G)
    assert recompute_attention(sel) == G.n_layers and recompute_attention(sel) == 0
    assert all(is_selective(b.attn.attend) for b in sel.blocks)
    x, y = _batch(0)
    for m in (plain, sel):
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    for (n, a), b in zip(plain.named_parameters(), sel.parameters()):
        assert torch.equal(a.grad, b.grad), n
    hf = make_hf("llama")
    assert recompute_attention(hf) == 4 and hf.config._attn_implementation == "colab_kit_selective:sdpa"
    assert isinstance(SelectiveCore(F.softmax), SelectiveCore)


def test_config_reads_every_spelling_and_refuses_others():
    P_ = ck.ParallelConfig
    assert [P_(recompute=v).recompute for v in (True, False, "full", "selective", "op", "none", "on", 0)] == \
        ["full", "none", "full", "selective", "op", "none", "full", "none"]
    c = P_(dp=2, recompute="selective")
    assert P_.from_dict(c.to_dict()) == c and c.describe() == "dp=2 = 2 ranks, selective recompute"
    assert P_.parse("dp=2 --recompute selective") == c == P_.parse("recompute=selective dp=2")
    with pytest.raises(ck.ConfigError, match=r"recompute must be 'none', 'selective', 'op' or 'full'.*did you mean "
                                             r"'selective'"):
        P_(recompute="selectve")
    with pytest.raises(ck.ConfigError, match=r"recompute must be 'none', 'selective', 'op' or 'full'"):
        P_(recompute=2)
    assert P_(recompute="OP").recompute == "op" and P_.parse("--recompute op").recompute == "op"

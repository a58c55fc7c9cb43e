"""``engine.generate``: equal token for token to the dense model generating in one process.

A small GPT (and a Hugging Face GPT-2) is trained in the test process with plain PyTorch on
``SyntheticTokens``, so that its argmax continues the progressions rather than repeating one
token; every rank boosts that trained dense model under a config and generates, and each rank's
tokens must equal the one-process loop's (greedy, and sampled with the same seed). One spawn per
world size, configs looped inside: dp, tp 1d / split_gather / 2d / 2.5d / 3d, pp 1f1b / gpipe /
interleaved / zb-v, ZeRO-3, sp ring and Ulysses, dp x tp, pp x tp, a GPT with dropout (off while
generating) and HF GPT-2 under tp and pp; the training flags are kept, and training goes on after
generating. The same checks fail on the untrained model's tokens, the
sampled tokens differ from the greedy ones, and what generation refuses is refused before any
collective.
"""
from __future__ import annotations

import functools

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import BERT, GPT, BERTConfig, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
DATA = SyntheticTokens(64, 16, seed=1)
NEW, TEMP, SEED = 8, 2.0, 7


def prompts() -> torch.Tensor:
    """3 rows (padded to the batch shards inside), 5 tokens: two progressions and one random row."""
    rows = DATA.batch(1000, 2)[0][:, :5]
    return torch.cat([rows, torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))])


def make_hf():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=4, n_head=4, n_positions=16, vocab_size=64, resid_pdrop=0, embd_pdrop=0,
        attn_pdrop=0, bos_token_id=0, eos_token_id=0))


def make(name: str, sd: dict | None = None, **kw):
    model = make_hf() if name == "gpt2" else GPT(GPTConfig(**{**CFG.__dict__, **kw}))
    if sd is not None:
        model.load_state_dict(sd)
    return model


def trained(name: str, steps: int = 40) -> dict:
    model = make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for s in range(steps):
        x, y = DATA.batch(s, 16)
        out = model(x)
        logits = out.logits if name == "gpt2" else out
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def weights() -> dict:
    return {"gpt": trained("gpt"), "gpt2": trained("gpt2", 20)}


@torch.no_grad()
def one_process(name: str, sd: dict | None, temperature: float = 0.0, seed: int = 0) -> torch.Tensor:
    """The dense model's own loop: one forward of the sequence so far per token, no padding."""
    model = make(name, sd).eval()
    g = torch.Generator().manual_seed(seed)
    ids = prompts()
    for _ in range(NEW):
        out = model(ids)
        logits = (out.logits if name == "gpt2" else out)[:, -1].float()
        nxt = logits.argmax(-1) if temperature == 0 else \
            torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g).squeeze(1)
        ids = torch.cat([ids, nxt[:, None]], 1)
    return ids


def _opt(ps):  # lr 0: a training step leaves the trained weights exactly as they were
    return torch.optim.SGD(ps, lr=0.0)


def _refusals(sd) -> dict:
    """What generate() refuses, each before any collective (the comm log does not grow)."""
    engine = ck.boost(make("gpt", sd), _opt, ck.ParallelConfig(pp=2, microbatches=2))
    p, out = prompts(), {}
    bad = {"long prompt": (torch.zeros(1, 17, dtype=torch.long), 1), "negative": (p, -1),
           "too many new": (p, 13), "float prompt": (p.float(), 2), "1-d prompt": (p[0], 2),
           "out of vocabulary": (p + 64, 2), "not a tensor": (p.tolist(), 2)}
    for what, (ids, n) in bad.items():
        before = len(engine.mesh.log.records)
        try:
            engine.generate(ids, n)
            out[what] = "not refused"
        except ValueError as e:  # ConfigError is a ValueError
            out[what] = len(engine.mesh.log.records) == before and len(str(e)) > 20
    out["zero new"] = torch.equal(engine.generate(p, 0), p)
    engine.close()
    for name, model in (("bert", BERT(BERTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2))),):
        engine = ck.boost(model, _opt, ck.ParallelConfig(tp=2))
        before = len(engine.mesh.log.records)
        try:
            engine.generate(p, 2)
            out[name] = "not refused"
        except ck.ConfigError as e:
            out[name] = "causal language model" in str(e) and len(engine.mesh.log.records) == before
        engine.close()
    return out


def _run(cases, sd_all, refusals=False) -> dict:
    out = {}
    for key, (name, kw, sample, extra) in cases.items():
        engine = ck.boost(make(name, sd_all[name], **extra), _opt, ck.ParallelConfig(**kw))
        if "train" in key:  # generation after a training step (and a step after it), with the weights unchanged
            engine.train_step(DATA.batch(0, 8))
        modes = [m.training for m in engine.module.modules()]
        res = {"greedy": engine.generate(prompts(), NEW)}
        if sample:
            res["sampled"] = engine.generate(prompts(), NEW, temperature=TEMP, seed=SEED)
        res["modes kept"] = modes == [m.training for m in engine.module.modules()]
        if "train" in key:
            res["trains after"] = engine.train_step(DATA.batch(1, 8)) > 0
        out[key] = res
        engine.close()
    if refusals:
        out["refusals"] = _refusals(sd_all["gpt"])
    return out


def _c(name, sample=False, extra=None, **kw):
    return name, kw, sample, extra or {}


CASES = {
    2: {"dp2": _c("gpt", True, dp=2), "tp2-1d": _c("gpt", True, tp=2),
        "tp2-split_gather": _c("gpt", tp=2, sp_mode="split_gather"),
        "pp2-1f1b": _c("gpt", True, pp=2, microbatches=2),
        "pp2-gpipe": _c("gpt", pp=2, microbatches=2, schedule="gpipe"),
        "pp2-interleaved": _c("gpt", pp=2, microbatches=2, schedule="interleaved", chunks=2),
        "pp2-zb-v": _c("gpt", pp=2, microbatches=2, schedule="zb-v", chunks=2),
        "dp2-zero3": _c("gpt", dp=2, zero=3), "sp2-ring": _c("gpt", sp=2),
        "sp2-ulysses": _c("gpt", sp=2, sp_mode="ulysses"),
        "tp2-dropout-train": _c("gpt", extra={"dropout": 0.1}, tp=2),
        "hf-tp2": _c("gpt2", True, tp=2), "hf-pp2": _c("gpt2", pp=2, microbatches=2)},
    4: {"tp4-2d": _c("gpt", True, tp=4, tp_mode="2d"), "dp2-tp2": _c("gpt", dp=2, tp=2),
        "pp2-tp2-train": _c("gpt", True, pp=2, tp=2, microbatches=2)},
    8: {"tp8-2.5d": _c("gpt", tp=8, tp_mode="2.5d", tp_depth=2), "tp8-3d": _c("gpt", True, tp=8, tp_mode="3d")},
}


@pytest.fixture(scope="module")
def runs():
    sd, out = weights(), {}
    for world, cases in CASES.items():
        results = ck.launch(_run, world, cases, sd, world == 2)
        for key in cases:
            out[key] = [r[key] for r in results]
        if world == 2:
            out["refusals"] = [r["refusals"] for r in results]
    return out


@pytest.fixture(scope="module")
def expected():
    sd = weights()
    return {name: {"greedy": one_process(name, sd[name]), "sampled": one_process(name, sd[name], TEMP, SEED),
                   "untrained": one_process(name, None)} for name in ("gpt", "gpt2")}


@pytest.mark.parametrize("key", [k for cs in CASES.values() for k in cs])
def test_generates_like_one_process(runs, expected, key):
    name, _, sample, _ = next(cs[key] for cs in CASES.values() if key in cs)
    want = expected[name]
    for rank, res in enumerate(runs[key]):
        assert torch.equal(res["greedy"], want["greedy"]), (rank, res["greedy"], want["greedy"])
        assert res["modes kept"], rank
        if sample:
            assert torch.equal(res["sampled"], want["sampled"]), (rank, res["sampled"], want["sampled"])
        if "train" in key:
            assert res["trains after"], rank


def test_the_check_can_fail(expected):
    """The untrained model continues differently, the draws differ from the argmax, and the trained
    GPT's argmax is not degenerate (it goes on along its progressions instead of repeating one token)."""
    for name in ("gpt", "gpt2"):
        want = expected[name]
        assert not torch.equal(want["untrained"], want["greedy"]), name
        assert not torch.equal(want["sampled"], want["greedy"]), name
    for row in expected["gpt"]["greedy"][:2, -NEW:]:
        assert len(set(row.tolist())) >= NEW - 1, row


def test_refusals_before_any_collective(runs):
    for rank, res in enumerate(runs["refusals"]):
        assert all(v is True for v in res.values()), (rank, res)

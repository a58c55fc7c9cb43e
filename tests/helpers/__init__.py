"""What several test files share: the small GPT and the two optimizers most parity tests train, the zoo of
models beyond GPT (BERT, ViT, a user's ``Net`` with its ``NET_POLICY``, their batches), and references written
in plain torch so that they check the engine rather than repeat it. Test files import from here, not from
each other.

``plain_mixed_precision``: the mixed-precision recipe in one process, nothing from ``colab_kit.engine.precision``: the
model cast to 16 bits, fp32 copies made from the 16-bit weights that the optimizer steps, the loss taken in
fp32 from the 16-bit logits, the 16-bit gradients cast to fp32 and unscaled (fp16 scales the loss by 2^16,
the engine's first scale, as ``torch.amp.GradScaler`` does), the stepped copies cast back.

``trained_like``: parameters count as trained like the reference when they are off its by under a tenth of
what training moved the reference from where it started, over the whole model. The untrained weights are off
by the whole update (ratio 1.0), so the check rejects them: each test that uses it asserts that too.
"""
from __future__ import annotations

import copy
import functools
import itertools
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colab_kit import comm
from colab_kit.config import ParallelConfig
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.reference import train_single_process
from colab_kit.models import BERT, GPT, BERTConfig, GPTConfig, ViT, ViTConfig
from colab_kit.pipeline import Action
from colab_kit.policy import Attention, Policy

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}

# the small GPT and the two optimizers most parity tests train (the contract names AdamW and SGD + momentum)
GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, BATCH = 5, 8
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
}


class Mixed(NamedTuple):
    losses: list[float]
    trained: dict      # {name: 16-bit tensor} after training
    start: dict        # ... and before it
    norms: list[float]  # the global gradient norm before clipping, each step (with max_grad_norm)


def plain_mixed_precision(model: torch.nn.Module, optimizer_factory: Callable, batches: Callable[[int], tuple],
                          steps: int, precision: str, logits: Callable = lambda out: out,
                          max_grad_norm: float | None = None) -> Mixed:
    """Train a 16-bit copy of ``model`` for ``steps`` steps. ``batches(step)`` -> ``(inputs, targets)``;
    ``logits(model(inputs))`` -> the logits (``out.logits`` for a Hugging Face model); ``max_grad_norm`` clips
    the fp32 gradients after unscaling (``clip_grad_norm_``)."""
    low = copy.deepcopy(model).to(LOW[precision])
    start = {n: p.detach().clone() for n, p in low.named_parameters()}
    params = list(low.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = optimizer_factory(masters)
    scale = 2.0 ** 16 if precision == "fp16" else 1.0
    losses, norms = [], []
    for step in range(steps):
        x, y = batches(step)
        x = x.to(LOW[precision]) if x.is_floating_point() else x
        out = logits(low(x)).float()
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        (loss * scale).backward()
        for m, p in zip(masters, params):
            m.grad = None if p.grad is None else p.grad.float() / scale
            p.grad = None
        assert all(torch.isfinite(m.grad).all() for m in masters if m.grad is not None), "an overflow in the reference"
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
        losses.append(loss.item())
    return Mixed(losses, {n: p.detach().clone() for n, p in low.named_parameters()}, start, norms)


def update_error(got: dict, ref: dict, start: dict) -> float:
    """||got - ref|| / ||ref - start|| over the tensors of ``got``: 0 is the reference's weights, 1 the start's."""
    err = sum(((got[n].float() - ref[n].float()) ** 2).sum() for n in got) ** 0.5
    moved = sum(((start[n].float() - ref[n].float()) ** 2).sum() for n in got) ** 0.5
    assert moved > 0, "the reference did not move: nothing to compare against"
    return float(err / moved)


def trained_like(got: dict, ref: dict, start: dict, within: float = 0.1) -> bool:
    return update_error(got, ref, start) < within


# =========================================================================== the small GPT, trained and read back
@functools.lru_cache(maxsize=None)
def gpt_reference(opt: str):
    """The small GPT trained in one process with plain torch: (losses, {name: trained parameter})."""
    losses, model = train_single_process(GPT_CFG, OPTIMIZERS[opt], SyntheticTokens(64, 16, seed=1), STEPS, BATCH)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def named_params(engine, kw) -> dict:
    """The trained parameters by their dense names (gathered over tp; this rank's stages with pp)."""
    with engine.gathered():  # ZeRO-3: the chunks whole while they are read
        return _dense_named(engine, kw)


def _dense_named(engine, kw) -> dict:
    if kw.get("pp", 1) > 1:
        return {n: p.detach().clone() for st in engine.module for n, p in zip(st.source_names, st.parameters())}
    if kw.get("tp", 1) > 1:
        from colab_kit.tensor.inspect import dense_state
        return dense_state(engine.module)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def with_unused(seed: int = 5) -> nn.Module:
    """The small GPT with a Linear its forward never calls (no gradient, ever)."""
    model = GPT(GPT_CFG)
    torch.manual_seed(seed)
    model.unused = nn.Linear(4, 4)  # never called by GPT.forward: no gradient, ever
    return model


def same_over_dp(engine) -> bool:
    """Every dp rank holds exactly the same parameters (the all-gather put them back whole)."""
    v = engine.state_vector()
    got = comm.all_gather(v, engine.mesh, "dp").view(engine.config.dp, -1)
    return all(torch.equal(row, v) for row in got)


# =========================================================================== models beyond GPT (test_models.py
# and the files that test the same zoo: dropout, memory, precision, placements, clipping)
# --------------------------------------------------------------------------- a user's own model
class Mixer(nn.Module):
    """Causal attention with its own names: ``wqkv`` (head by head), ``wo``, ``heads``."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wqkv, self.wo = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        return self.wo(self.attend(q, k, v).transpose(1, 2).reshape(b, t, -1))

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm_a, self.mix, self.norm_b = nn.LayerNorm(d), Mixer(d, heads), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.mix(self.norm_a(x))
        return x + self.ff(self.norm_b(x))


class Net(nn.Module):
    def __init__(self, vocab=64, seq=16, d=32, heads=4, depth=4):
        super().__init__()
        torch.manual_seed(7)  # the same weights on every rank
        self.words, self.where = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(depth))
        self.final, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def embed(self, ids):
        return self.words(ids) + self.where(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.final(x))


NET_POLICY = Policy(
    name="net", blocks="layers",
    layers={"words": "vocab", "where": "positions", "final": "norm", "out": "head",
            "layers.*.norm_a": "norm", "layers.*.norm_b": "norm",
            "layers.*.mix.wqkv": "column", "layers.*.mix.wo": "row",
            "layers.*.ff.0": "column", "layers.*.ff.2": "row"},
    attention={"layers.*.mix": Attention(heads=("heads",), attend="attend")},
    embed=lambda m, ids: m.embed(ids), finish=lambda m, x: m.out(m.final(x)), tail=("final", "out"))


# --------------------------------------------------------------------------- models and their data
BERT_CFG = BERTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
VIT_CFG = ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, d_model=32, n_heads=4, n_layers=4)
ZOO_GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)


def make(name: str, tie: bool = True) -> nn.Module:
    """gpt, bert (its head tied to the token table, or not), vit, gpt2 / llama (Hugging Face's) or net (Net)."""
    if name in ("gpt2", "llama"):
        return make_hf(name)
    if name == "gpt":
        return GPT(ZOO_GPT_CFG)
    if name == "bert":
        return BERT(BERTConfig(**{**BERT_CFG.__dict__, "tie_embeddings": tie}))
    if name == "vit":
        return ViT(VIT_CFG)
    return Net()


def mlm_batch(step: int, rows: int = BATCH):
    """Masked-LM batches: ids in 2..63 with trailing padding (id 0) on some rows, about a quarter of the
    real tokens predicted (their input replaced by id 1), -100 elsewhere: every shard counts differently."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(2, 64, (rows, 16), generator=g)
    lengths = torch.randint(6, 17, (rows, 1), generator=g)
    real = torch.arange(16) < lengths
    ids = torch.where(real, ids, 0)
    picked = (torch.rand(rows, 16, generator=g) < 0.25) & real
    picked[0, 0] = True  # at least one
    targets = torch.where(picked, ids, -100)
    return torch.where(picked, 1, ids), targets


def digits():
    from colab_kit.datasets.images import load_digits  # scikit-learn's digits, without importing it on every rank
    return load_digits()


def batch(name: str, step: int):
    if name == "bert":
        return mlm_batch(step)
    if name == "vit":
        x, y = digits()
        i = torch.arange(step * BATCH, (step + 1) * BATCH)
        return x[i], y[i]
    return SyntheticTokens(64, 16, seed=1).batch(step, BATCH)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


def make_hf(name: str):
    """A small Hugging Face GPT-2 or Llama, built from a config (no download), the same weights on every rank."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, n_positions=16, vocab_size=64, resid_pdrop=0, embd_pdrop=0,
            attn_pdrop=0, bos_token_id=0, eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def assert_params_match(got: dict, want: dict, opt: str, where) -> None:
    """Final parameters equal the single process's, every one of them. AdamW divides each gradient
    by its own running size, so an element whose gradient is at rounding noise can move by a small
    fraction of lr either way: its atol is looser; SGD (which sees the gradient's scale) stays tight.
    Both are far below what five steps move a weight (about 5 lr = 1.5e-2 for AdamW), so the untrained
    weights fail."""
    assert sorted(got) == sorted(want), where
    atol = 2e-4 if opt == "adamw" else 5e-5
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=atol, msg=lambda m: f"{where} {name}: {m}")


# =========================================================================== memory and pipeline plans
# ~10.6 MB dense; the largest parameters are the token table and the head (2 MiB each)
BIG = GPTConfig(vocab_size=2048, seq_len=32, d_model=256, n_heads=8, n_layers=2)


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive (``live``) and their maximum (``peak``) while the mode is on.

    Every op's output storage is counted once, when it first appears, and subtracted when the
    storage is freed (``weakref.finalize`` on it: torch keeps one Python object per storage
    for as long as the storage lives). Views share their base's storage, so a slice costs
    nothing and a clone costs its bytes. ``mark(name)`` keeps the peak so far under ``name``.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.marks: dict[str, int] = {}
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._alive:
            return
        self._alive.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def mark(self, name: str) -> None:
        self.marks[name] = self.peak


def dense_sizes(cfg: GPTConfig) -> tuple[int, int]:
    """Bytes of the dense model and of its largest parameter (from shapes: a meta model)."""
    sizes = [p.numel() * p.element_size() for p in GPT(cfg, device="meta").parameters()]
    return sum(sizes), max(sizes)


def assert_one_f_i_w_each(plan, pp: int, m: int) -> None:
    """ZB-V's count rule: exactly one F, one I and one W per stage and microbatch."""
    acts = [a for row in plan.actions for a in row]
    every = sorted(itertools.product(range(2 * pp), range(m)))
    for kind in "FIW":
        assert sorted((a.stage, a.microbatch) for a in acts if a.kind == kind) == every, (pp, m, kind)
    assert len(acts) == 3 * len(every)


def assert_f_i_w_in_order(plan, pp: int, m: int) -> None:
    """ZB-V's order rule on each rank: F before I before W of a microbatch; microbatches in order."""
    for row in plan.actions:
        at = {a: i for i, a in enumerate(row)}
        for a in row:
            if a.kind == "F":
                assert at[a] < at[Action(a.stage, "I", a.microbatch)] < at[Action(a.stage, "W", a.microbatch)]
        for s in {a.stage for a in row}:
            for kind in "FIW":
                assert [a.microbatch for a in row if (a.stage, a.kind) == (s, kind)] == list(range(m)), (pp, m)


# =========================================================================== a script under torchrun (test_join, test_two_hosts)
TORCHRUN_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torchrun_train.py"
TORCHRUN_STEPS = 4


def torchrun_reference():
    """The losses tests/scripts/torchrun_train.py must print: GPT_CFG with SGD + momentum in one process."""
    from colab_kit.engine.reference import single_process_losses
    return single_process_losses(GPT_CFG, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                 SyntheticTokens(64, 16, seed=1), TORCHRUN_STEPS, 8)[0]


def torchrun(args, env=None, prefix=()):
    return [*prefix, sys.executable, "-m", "torch.distributed.run", *args, str(TORCHRUN_SCRIPT)]


# =========================================================================== made-up planner candidates (viz, widgets)
MIB = 2**20


def planner_candidate(cfg, device_mib, ms, fits, why="compute", host_mib=0):
    dev = {"params": device_mib * MIB, "grads": 0, "optimizer": 0, "activations": 0}
    host = {"params": 0, "grads": 0, "optimizer": host_mib * MIB, "activations": 0}
    return SimpleNamespace(config=cfg, memory={"params": device_mib * MIB, "grads": 0, "optimizer": host_mib * MIB,
                                               "activations": 0, "device": dev, "host": host},
                           step_seconds=ms / 1e3, fits=fits, why=why)


CANDS = [planner_candidate(ParallelConfig(dp=4), 3, 20, True, "compute 80%"),
         planner_candidate(ParallelConfig(dp=4, zero=3, offload="cpu"), 1, 40, True, "host copies", host_mib=6),
         planner_candidate(ParallelConfig(tp=4), 9, 30, False, "tp all-reduce"),
         planner_candidate(ParallelConfig(pp=4, microbatches=4), 10, 50, False, "bubble 43%")]

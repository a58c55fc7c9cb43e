"""Any model through its policy: BERT, ViT, GPT and a user's own model (attributes named unlike GPT's,
sharded through a ``Policy`` written here) each train three steps to the losses and parameters of the
same model trained in one process with plain PyTorch (``F.cross_entropy``, its ``ignore_index``), under tp 1d and 2d, pp 1f1b, zb-h1 and zb-v (BERT's tied head and
token table on two pipeline ranks, or on one under zb-v), ZeRO-3, and dp x tp x pp; ViT also under
2.5d and 3d, BERT under 3d (its MLM dense and tied decoder), on scikit-learn's digits; BERT (bidirectional, padding masked) and the user's model under
sp ring and Ulysses. BERT's batches predict a different number of tokens in every shard, so the
global masked-LM mean is checked, not a mean of means. One spawn per world size, configs looped inside.

Each config trains with one optimizer (``optimizer_of``): SGD + momentum where every parameter is compared
(tp=1, ZeRO below 3: the dense names exist on the rank), AdamW where the parameters are sharded (tp, ZeRO-3),
whose optimizer states then live in the shards too. Both optimizers are elementwise, so once SGD's parameters
match, the gradients match and AdamW over them would too; what AdamW adds is its sharded states, which is
where it runs. Every model trains with both (``test_every_model_trains_with_both_optimizers``).

What is refused, in the kernel before any process: a model without a policy under tp/pp/sp, a policy
whose paths the model lacks, sizes that do not divide, a mode a model's parts cannot take.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import colab_kit as ck
from colab_kit.models import BERT, BERTConfig, ViT, ViTConfig
from colab_kit.policy import Policy

from tests.helpers import case_id, rank0_per_world
from tests.helpers import (BATCH, BERT_CFG, NET_POLICY, OPTIMIZERS, STEPS, VIT_CFG, Net, Plain, batch, digits, make,
                           mlm_batch)

RTOL = 1e-5


def plain_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@functools.lru_cache(maxsize=None)
def reference(name: str, opt: str, tie: bool = True):
    """Plain PyTorch in one process: the model, its optimizer, F.cross_entropy, ``STEPS`` steps."""
    model = make(name, tie)
    optimizer = OPTIMIZERS[opt](model.parameters())
    losses = []
    for s in range(STEPS):
        x, y = batch(name, s)
        loss = plain_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _policy(name):
    return NET_POLICY if name == "net" else None


# --------------------------------------------------------------------------- on each rank
def _dense(kw) -> bool:
    """Whether a rank holds its parameters under their dense names and shapes: tp=1 and ZeRO below 3."""
    return kw.get("tp", 1) == 1 and kw.get("zero", 0) < 3


def optimizer_of(kw) -> str:
    """The optimizer a config trains with here: SGD + momentum where its parameters are compared, AdamW where
    they are sharded (see the module docstring)."""
    return "sgd" if _dense(kw) else "adamw"


def _train(cases):
    out = {}
    for name, kw, tie in cases:
        opt = optimizer_of(kw)
        engine = ck.boost(make(name, tie), OPTIMIZERS[opt], ck.ParallelConfig(**kw), policy=_policy(name))
        losses = [engine.train_step(batch(name, s)) for s in range(STEPS)]
        params = {}
        if _dense(kw):
            if engine.pipeline is not None:
                params = {n: p.detach().clone() for st in engine.module
                          for n, p in zip(st.source_names, st.parameters())}
            else:
                params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        out[name, tuple(sorted(kw.items())), tie] = (losses, params)
        engine.close()
    return out


CASES = {
    2: [(m, kw, True) for m in ("bert", "vit", "net") for kw in
        (dict(tp=2), dict(pp=2, microbatches=2, schedule="1f1b"), dict(pp=2, microbatches=2, schedule="zb-h1"),
         dict(dp=2, zero=3))
        if not (m == "bert" and "pp" in kw)]
       + [("bert", dict(pp=2, microbatches=2, schedule=s), tie) for s in ("1f1b", "zb-h1") for tie in (True, False)]
       + [("bert", dict(pp=2, microbatches=2, schedule="zb-v", chunks=2), True),
          ("gpt", dict(tp=2, recompute=True), True), ("vit", dict(dp=2, recompute=True), True)]
       + [(m, dict(sp=2, sp_mode=mode), True) for m in ("bert", "net") for mode in ("ring", "ulysses")]
       + [(m, dict(pp=2, microbatches=4, schedule="interleaved", chunks=2), m != "bert") for m in ("bert", "vit", "net")]
       + [("net", dict(tp=2, sp_mode="split_gather"), True), ("vit", dict(pp=2, microbatches=2, schedule="gpipe"), True)],
    4: [(m, dict(tp=4, tp_mode="2d"), True) for m in ("bert", "vit", "net")]
       + [("bert", dict(dp=2, sp=2, sp_mode="ring"), True), ("bert", dict(tp=2, sp=2, sp_mode="ulysses"), True)],
    8: [(m, dict(dp=2, tp=2, pp=2, microbatches=2), True) for m in ("bert", "vit", "net")]
       + [("vit", dict(tp=8, tp_mode="2.5d", tp_depth=2), True), ("vit", dict(tp=8, tp_mode="3d"), True)]
       + [("bert", dict(tp=8, tp_mode="3d"), tie) for tie in (True, False)],
}


@pytest.fixture(scope="module")
def runs():
    return rank0_per_world(_train, CASES)


def _close(a, b, rtol=RTOL):
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", [(w, *c) for w, cs in CASES.items() for c in cs],
                         ids=lambda c: case_id(c, 1))
def test_trains_like_one_process(runs, case):
    _, name, kw, tie = case
    opt = optimizer_of(kw)
    losses, params = runs[name, tuple(sorted(kw.items())), tie]
    ref_losses, ref_params = reference(name, opt, tie)
    assert _close(losses, ref_losses), (opt, losses, ref_losses)
    assert abs(ref_losses[-1] - ref_losses[0]) > 100 * RTOL * abs(ref_losses[0])  # it did train
    assert bool(params) == (opt == "sgd")  # (Adam normalises float noise: a key bias, whose true gradient is 0,
    for n, p in params.items():            # moves by ~lr on noise whatever the split, so only SGD's are compared)
        assert torch.allclose(p, ref_params[n], rtol=1e-4, atol=1e-5), (opt, n)
    # the untrained weights would not pass: training moved some tensor further than the tolerance
    moved = [n for n in params if not torch.allclose(make(name, tie).state_dict()[n], ref_params[n],
                                                     rtol=1e-4, atol=1e-5)]
    assert not params or moved


def test_every_model_trains_with_both_optimizers():
    used = {(c[0], optimizer_of(c[1])) for cs in CASES.values() for c in cs}
    assert used == {(m, o) for m in ("bert", "vit", "net") for o in OPTIMIZERS} | {("gpt", "adamw")}, used


def test_masked_lm_loss_is_the_global_mean_not_a_mean_of_means():
    """BERT's batches count different numbers of targets per dp shard: the two means differ here,
    so the dp runs above check the global one."""
    x, y = mlm_batch(0)
    logits = torch.randn(BATCH, 16, 64)
    full = plain_loss(logits, y)
    halves = [plain_loss(logits[i:i + 4], y[i:i + 4]) for i in (0, 4)]
    assert (y[:4] != -100).sum() != (y[4:] != -100).sum()
    assert abs((halves[0] + halves[1]) / 2 - full) > 1e-3


def test_vit_learns_the_digits():
    """Three hundred steps on real images: accuracy on held-out digits rises well above chance."""
    torch.manual_seed(0)
    x, y = digits()
    model = ViT(ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, d_model=32, n_heads=4,
                          n_layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for s in range(300):
        i = torch.randint(0, 1400, (32,))
        loss = plain_loss(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(x[1400:]).argmax(-1) == y[1400:]).float().mean().item()
    assert acc > 0.6, acc  # chance is 0.1


# --------------------------------------------------------------------------- refused in the kernel
def _opt(ps):
    return torch.optim.SGD(ps, lr=0.1)


def test_a_model_without_policy_is_refused_with_how_to_write_one():
    with pytest.raises(ck.ConfigError, match=r"tp=2 needs a sharding policy for Plain.*policy=Policy\(blocks="):
        ck.boost(Plain(), _opt, ck.ParallelConfig(tp=2))
    with pytest.raises(ck.ConfigError, match=r"pp=2 needs a sharding policy for Plain"):
        ck.boost(Plain(), _opt, ck.ParallelConfig(pp=2))
    with pytest.raises(ck.ConfigError, match=r"recompute=True needs a sharding policy"):
        ck.boost(Plain(), _opt, ck.ParallelConfig(dp=2, recompute=True))


def test_a_policy_that_does_not_fit_names_the_paths():
    wrong = Policy(blocks="layers", layers={"words": "vocab", "layers.*.mix.q": "column", "out": "row"},
                   embed=NET_POLICY.embed, finish=NET_POLICY.finish)
    with pytest.raises(ck.ConfigError, match=r"layers.0.mix.q \(column\) is missing.*layers.3.mix.q"):
        ck.boost(Net(), _opt, ck.ParallelConfig(tp=2), policy=wrong)
    with pytest.raises(ck.ConfigError, match=r"words is Embedding, where role 'norm' needs nn.LayerNorm"):
        ck.boost(Net(), _opt, ck.ParallelConfig(tp=2), policy=Policy(
            blocks="layers", layers={"words": "norm"}, embed=NET_POLICY.embed, finish=NET_POLICY.finish))
    with pytest.raises(ValueError, match="unknown roles"):
        Policy(blocks="layers", layers={"words": "embedding"}, embed=None, finish=None)


def test_sizes_that_do_not_divide_are_refused_with_the_rule():
    with pytest.raises(ck.ConfigError, match=r"num_classes=10 not divisible by 4: tp_mode='1d'"):
        ck.boost(ViT(VIT_CFG), _opt, ck.ParallelConfig(tp=4))
    with pytest.raises(ck.ConfigError, match=r"n_heads=3 not divisible by 2"):
        ck.boost(BERT(BERTConfig(d_model=48, n_heads=3)), _opt, ck.ParallelConfig(tp=2))
    odd = ViTConfig(image_size=6, patch_size=3, channels=1, num_classes=10, d_model=32, n_heads=4)
    with pytest.raises(ck.ConfigError, match=r"input features=9 not divisible by 2: tp_mode='2d'"):
        ck.boost(ViT(odd), _opt, ck.ParallelConfig(tp=4, tp_mode="2d"))
    with pytest.raises(ck.ConfigError, match=r"n_layers=4 does not split evenly over pp\*chunks = 3\*1"):
        ck.boost(Net(), _opt, ck.ParallelConfig(pp=3), policy=NET_POLICY)


def test_modes_a_model_cannot_take_yet_say_so():
    with pytest.raises(ck.ConfigError, match=r"mlm.decoder shares its weight with tok.*ZeRO's flat pieces .*zero=0"):
        ck.boost(BERT(BERT_CFG), _opt, ck.ParallelConfig(dp=2, pp=2, schedule="1f1b", zero=1))
    with pytest.raises(ck.ConfigError, match=r"inputs have no token dimension \(ViT's are images"):
        ck.boost(ViT(VIT_CFG), _opt, ck.ParallelConfig(sp=2))
    with pytest.raises(ck.ConfigError, match=r"split_gather' splits the sequence of models .* also has input \(patch\), table \(cls\)"):
        ck.boost(ViT(VIT_CFG), _opt, ck.ParallelConfig(tp=2, sp_mode="split_gather"))


# --------------------------------------------------------------------------- checkpoints that reshard
SAVED_AFTER = 1  # steps before a checkpoint is saved; STEPS - SAVED_AFTER = 2 after its load


def _save_then_load(pairs, root):
    """Per pair: one step under config a, save; a new engine under config b loads it and runs steps 2-3 (the second
    of them moves by the loaded momentum, so a lost optimizer state shows)."""
    out = {}
    for i, (name, a, b, tie) in enumerate(pairs):
        path = f"{root}/pair{i}"
        first = []
        if ck.ParallelConfig(**a).world_size == torch.distributed.get_world_size():
            engine = ck.boost(make(name, tie), OPTIMIZERS["sgd"], ck.ParallelConfig(**a), policy=_policy(name))
            first = [engine.train_step(batch(name, s)) for s in range(SAVED_AFTER)]
            engine.save(path)
            engine.close()
        engine = ck.boost(make(name, tie), OPTIMIZERS["sgd"], ck.ParallelConfig(**b), policy=_policy(name))
        engine.load(path)
        out[i] = first + [engine.train_step(batch(name, s)) for s in range(SAVED_AFTER, STEPS)]
        engine.close()
    return out


RESHARD = [("bert", dict(tp=2), dict(pp=2, microbatches=2, schedule="zb-h1"), True),
           ("vit", dict(pp=2, microbatches=2), dict(tp=2), True),
           ("net", dict(dp=2, zero=2), dict(tp=2), True),
           ("bert", dict(dp=2, zero=1), dict(pp=2, microbatches=2, schedule="1f1b"), False)]


def test_checkpoints_reshard_between_configs(tmp_path):
    """One step under one config + two under another equal three in one process: the checkpoint finds where every
    element lives from the engine's placement table (any model)."""
    got = ck.launch(_save_then_load, 2, RESHARD, str(tmp_path))[0]
    for i, (name, a, b, tie) in enumerate(RESHARD):
        want = reference(name, "sgd", tie)[0]
        assert len(got[i]) == STEPS and _close(got[i], want), (a, b, got[i], want)


def _key_mask_gathers(layers):
    cfg = BERTConfig(**{**BERT_CFG.__dict__, "n_layers": layers})
    engine = ck.boost(BERT(cfg), OPTIMIZERS["sgd"], ck.ParallelConfig(sp=2, microbatches=2))
    engine.train_step(mlm_batch(0))
    return sum(r["tag"] == "key mask" for r in engine.comm(last_step=True))


def test_the_padding_mask_is_gathered_once_per_microbatch_not_per_layer():
    """Every layer attends with the same key-padding mask: each microbatch all-gathers it over sp once."""
    assert ck.launch(_key_mask_gathers, 2, 4)[0] == 2

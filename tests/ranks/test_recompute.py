"""Recomputation (``recompute=True``): same losses as one process, fewer activations, more FLOPs.

One spawn of 2 ranks runs dp=2, tp=2 (1d), pp=2 (1f1b) and pp=2 (zb-h1), each with recompute on
(AdamW and SGD + momentum), with per-op selective checkpointing (``recompute="op"``, the same two) and off
(SGD), and reports losses, parameters, memory and comm. The config field and the FLOP count are checked in
this process.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.core import lm_loss
from colab_kit.memory import ActivationMeter, activation_bytes
from colab_kit.memory.saves import BlockSaves
from colab_kit.models import GPT, GPTConfig
from colab_kit.recompute import is_recomputed, recompute_blocks
from colab_kit.recompute.op import SAVED_OPS, is_op_recomputed, op_policy, recompute_ops
from colab_kit.engine.reference import train_single_process

from tests.helpers import OPTIMIZERS

GPT4 = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
STEPS, BATCH = 3, 8
CONFIGS = {
    "dp=2": dict(dp=2),
    "tp=2": dict(tp=2),
    "pp=2 1f1b": dict(pp=2, microbatches=4, schedule="1f1b"),
    "pp=2 zb-h1": dict(pp=2, microbatches=4, schedule="zb-h1"),
}


@functools.lru_cache(maxsize=None)
def reference(opt: str):
    losses, model = train_single_process(GPT4, OPTIMIZERS[opt], SyntheticTokens(64, 16, seed=1), STEPS, BATCH)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _params(engine) -> dict:
    """This rank's parameters under their dense names (whole tensors where tp=1)."""
    if engine.pipeline is not None:
        return {n: p.detach().clone() for st in engine.module for n, p in zip(st.source_names, st.parameters())}
    if engine.config.tp == 1:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    from colab_kit.tensor.inspect import dense_state
    return {n: t.clone() for n, t in dense_state(engine.module).items()}


def _train(configs):
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for name, kw in configs.items():
        for recompute, opt in ((True, "adamw"), (True, "sgd"), ("op", "adamw"), ("op", "sgd"), (False, "sgd")):
            engine = ck.boost(GPT(GPT4), OPTIMIZERS[opt], ck.ParallelConfig(recompute=recompute, **kw))
            losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
            blocks = [b for st in engine.module for b in st.blocks] if engine.pipeline else engine.module.blocks
            tp_all_reduces = sum(r["op"] == "all_reduce" and r["axis"] == "tp" for r in engine.comm(last_step=True))
            wrapped = is_op_recomputed if recompute == "op" else is_recomputed
            out[name, recompute, opt] = dict(losses=losses, memory=engine.memory(), tp_all_reduces=tp_all_reduces,
                                             recomputed=[wrapped(b) for b in blocks], params=_params(engine),
                                             estimate=engine.memory_estimate()["activations"])
            engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    return ck.launch(_train, 2, CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", [True, "op"], ids=["full", "op"])
def test_recompute_matches_single_process(results, name, mode):
    for opt in OPTIMIZERS:
        ref_losses, ref_params = reference(opt)
        for rank, res in enumerate(results):
            got = res[name, mode, opt]
            assert all(got["recomputed"]) and got["recomputed"], (name, rank)
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (name, opt, rank)
            atol = 2e-4 if opt == "adamw" else 5e-5  # see test_pipeline_engine: Adam on rounding-noise gradients
            for n, p in got["params"].items():
                torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=atol,
                                           msg=lambda m: f"{name} {opt} {n} {m}")
        # the same with recompute off, bit for bit up to float reassociation
        for rank, res in enumerate(results):
            assert res[name, mode, "sgd"]["losses"] == pytest.approx(res[name, False, "sgd"]["losses"], rel=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recompute_holds_a_fraction_of_the_activations(results, name):
    for rank, res in enumerate(results):
        on, off = res[name, True, "sgd"]["memory"], res[name, False, "sgd"]["memory"]
        if name == "pp=2 zb-h1" and rank == 1:
            # zb-h1's last stage splits I and W: from I to W its store keeps every linear's input and output
            # gradient, recomputed or not, and two stores at once outweigh any forward's (the executor's peak
            # counts a store from its I): 2 x 143,360 B, whatever the recomputation
            store = BlockSaves.of_gpt(GPT4).store(BATCH // 4 * GPT4.seq_len, 4, 1, 2, True)
            assert on["activations"] == 2 * store <= off["activations"], (rank, on, off, store)
            continue
        assert 0 < on["activations"] < 0.25 * off["activations"], (name, rank, on, off)
        assert {k: on[k] for k in ("params", "grads", "optimizer")} == \
               {k: off[k] for k in ("params", "grads", "optimizer")}


def test_recompute_measured_activations_agree_with_the_estimate(results):
    """The estimate per rank within 10%: dp=2 holds half the rows, tp=2 (1d) all rows with the
    inner activations split, a pp stage its blocks times the microbatches it holds at its peak."""
    from colab_kit.pipeline import build_plan, lower, simulate

    held = simulate(lower(build_plan("1f1b", 2, 4, 1))).peak_held  # microbatches in flight per pp rank
    for rank, res in enumerate(results):
        for rc in (True, False):
            stage = activation_bytes(GPT4, BATCH // 4, layers=2, first=rank == 0, last=rank == 1, recompute=rc)
            want = {"dp=2": activation_bytes(GPT4, BATCH // 2, recompute=rc)["held"],
                    "tp=2": activation_bytes(GPT4, BATCH, tp=2, recompute=rc)["held"],
                    "pp=2 1f1b": held[rank] * stage["held"]}
            for name, bytes_ in want.items():
                got = res[name, rc, "sgd"]["memory"]["activations"]
                assert got == pytest.approx(bytes_, rel=0.1), (name, rank, rc, got, bytes_)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_op_holds_between_none_and_full_as_estimated(results, name):
    """"op" keeps each block's input, qkv's and fc1's outputs and the attention kernel's: strictly between
    "none" and "full" on every rank, and ``engine.memory_estimate()`` is off from the meter by one offset
    shared by the three modes (outside the blocks: the meter counts the token ids and targets of the rank's
    slice as the whole batch's storage, under 2 KiB here), zb-h1's last stage too: its weight stores (each
    Linear's input and output gradient, ``memory.layout._weight_store``) counted where they peak."""
    for rank, res in enumerate(results):
        got = {m: res[name, m, "sgd"] for m in (False, "op", True)}
        held = {m: g["memory"]["activations"] for m, g in got.items()}
        if name == "pp=2 zb-h1" and rank == 1:  # two weight stores at once: the peak whatever is recomputed
            assert held[False] > held["op"] == held[True] > 0, (name, rank, held)
        else:
            assert held[False] > held["op"] > held[True] > 0, (name, rank, held)
        offset = {m: held[m] - g["estimate"] for m, g in got.items()}
        whole_batch = 2 * 8 * BATCH * GPT4.seq_len  # int64 token ids and targets of the global batch
        # zb-h1's last stage: "none" measures 32 B more than its estimate, "op" and "full" none (not traced)
        spread = 32 if name == "pp=2 zb-h1" and rank == 1 else 0
        assert max(offset.values()) - min(offset.values()) <= spread, (name, rank, offset)
        assert 0 <= offset["op"] < whole_batch, (name, rank, offset)


def test_recompute_runs_one_more_tp_all_reduce_per_block(results):
    """1D tp: the recomputation runs attn.proj's forward all-reduce again (it stops before fc2's), and the price
    of the engine's stack (``Stack.checkpoint="early_stop"``) counts that one."""
    for res in results:
        on, off = res["tp=2", True, "sgd"]["tp_all_reduces"], res["tp=2", False, "sgd"]["tp_all_reduces"]
        assert on - off == GPT4.n_layers, (on, off)
        # "op": colab_kit's all-reduce is c10d's in-place op, which a saved output cannot replay: it runs again too
        assert res["tp=2", "op", "sgd"]["tp_all_reduces"] == on
    # the at-scale price of the engine's stack counts the same one more a block (torch's early stop)
    from colab_kit.planner.cluster.price import price
    from colab_kit.planner.shape import ModelShape
    counts = {r: price(ModelShape.of(GPT4), ck.ParallelConfig(tp=2, recompute=r), BATCH, "8xH100-SXM").collectives[
        "tp"] for r in (True, False, "op")}
    assert counts[True] - counts[False] == counts["op"] - counts[False] == GPT4.n_layers


def _step_flops(model, x, y) -> int:
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x), y).backward()
    return counter.get_total_flops()


def test_recompute_really_runs_the_blocks_forward_again():
    """A recomputed step costs one more forward of every block, less fc2's matmul (torch's checkpoint
    stops once fc2's input, the last saved tensor, is rebuilt)."""
    x, y = SyntheticTokens(64, 16, seed=1).batch(0, BATCH)
    plain, recomputed = GPT(GPT4), GPT(GPT4)
    assert recompute_blocks(recomputed) == GPT4.n_layers
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            plain.blocks[0](plain.embed(x))
    n, h, f = BATCH * GPT4.seq_len, GPT4.d_model, GPT4.d_ff
    block_forward = fwd.get_total_flops()
    extra = _step_flops(recomputed, x, y) - _step_flops(plain, x, y)
    assert extra == GPT4.n_layers * (block_forward - 2 * n * f * h)


def test_op_repeats_every_second_matmul_and_keeps_the_attention_kernel():
    """One step of the 4-block GPT, FlopCounterMode: "none" 39,321,600 FLOPs, "op" 40,370,176, "full" 47,710,208.
    "op" repeats exactly ``proj``'s matmul a block (qkv's and fc1's outputs and the attention kernel's are kept;
    fc2's, the other recomputed one, is past torch's early stop); the meter (``ActivationMeter``) sees exactly
    ``activation_bytes(..., recompute="op")`` (666,756 B against 1,133,700 and 134,276), gradients are the plain
    model's bit for bit. A policy that kept every matmul, none, or not the kernel would miss these counts."""
    x, y = SyntheticTokens(64, 16, seed=1).batch(0, BATCH)
    models = {"none": GPT(GPT4), "op": GPT(GPT4), "full": GPT(GPT4)}
    assert recompute_ops(models["op"]) == recompute_blocks(models["full"]) == GPT4.n_layers
    flops, held = {}, {}
    for mode, model in models.items():
        meter = ActivationMeter(exclude=list(model.parameters()))
        with FlopCounterMode(display=False) as counter:
            with meter.measure():
                loss = lm_loss(model(x), y)
            loss.backward()
        flops[mode], held[mode] = counter.get_total_flops(), meter.last
    n, h = BATCH * GPT4.seq_len, GPT4.d_model
    assert flops["none"] < flops["op"] < flops["full"], flops
    assert flops["op"] - flops["none"] == GPT4.n_layers * 2 * n * h * h, flops
    assert held["none"] > held["op"] > held["full"], held
    assert held == {m: activation_bytes(GPT4, BATCH, recompute=m)["held"] for m in held}, held
    for (name, a), b in zip(models["none"].named_parameters(), models["op"].parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert recompute_ops(models["op"]) == 0 and is_op_recomputed(models["op"].blocks[0])


def test_op_policy_keeps_every_second_matmul_and_the_kernels():
    """The policy itself: matmuls 1, 3, 5 kept and 2, 4 recomputed (the count restarts with each block's
    policy), the attention kernel and functional collectives kept, anything else recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
    aten = torch.ops.aten
    ctx = SelectiveCheckpointContext(is_recompute=False)
    p, kernel = op_policy(), aten._scaled_dot_product_flash_attention_for_cpu.default
    ops = (aten.addmm.default, aten.mm.default, kernel, aten.addmm.default, aten.gelu.default, aten.mm.default,
           aten.addmm.default)
    got = [p(ctx, op) == CheckpointPolicy.MUST_SAVE for op in ops]
    assert got == [True, False, True, True, False, False, True]
    assert op_policy()(ctx, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert torch.ops._c10d_functional.all_reduce.default in SAVED_OPS


def test_recompute_config_field():
    P = ck.ParallelConfig
    assert P().recompute == "none" and P(recompute=True).recompute == "full"  # stored as the mode's name
    assert P(dp=2, recompute=True).describe() == "dp=2 = 2 ranks, recompute"
    assert P(dp=2).describe() == "dp=2 = 2 ranks"
    c = P(dp=2, recompute=True)
    assert P.from_dict(c.to_dict()) == c and P(**c.to_dict()) == c
    assert P.parse("dp=2 --recompute").recompute == "full" and P.parse("--recompute --dp 2").dp == 2
    assert P.parse("recompute=on").recompute == "full" and P.parse("--recompute off").recompute == "none"
    assert P.parse("recompute=True dp=2").recompute == P.from_dict({"recompute": 1}).recompute == "full"
    with pytest.raises(ck.ConfigError, match="recompute must be 'none', 'selective', 'op' or 'full'.*got 'maybe'"):
        P.parse("recompute=maybe")
    with pytest.raises(ck.ConfigError, match="recompute must be 'none', 'selective', 'op' or 'full'"):
        P(recompute="maybe")
    c = P(dp=2, recompute="op")
    assert c.describe() == "dp=2 = 2 ranks, op recompute" and P.parse("dp=2 --recompute op") == c == P.from_dict(
        c.to_dict()) and "op" in ck.config.RECOMPUTES
    with pytest.raises(ck.ConfigError, match=r"recompute='op' keeps every second matmul's output, and tp_mode='2d' "
                                             r"\(SUMMA\).*use recompute='op' with tp_mode='1d' or '3d'"):
        P(tp=4, tp_mode="2d", recompute="op")
    with pytest.raises(ck.ConfigError, match=r"recompute='op' .* tp_mode='2.5d'"):
        P(tp=8, tp_mode="2.5d", tp_depth=2, recompute="op")
    assert P(tp=8, tp_mode="3d", recompute="op").recompute == "op"  # 3D adds no product into a kept one


def test_recompute_refuses_a_model_without_blocks():
    with pytest.raises(ck.ConfigError, match=r"recompute=True \(which checkpoints each block\) needs a sharding "
                                             r"policy for Linear"):
        recompute_blocks(torch.nn.Linear(2, 2))

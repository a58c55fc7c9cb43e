"""Megatron sequence parallelism inside the tp group (``sp_mode="split_gather"``, arXiv 2205.05198):
GPT training against one process, the collectives per block against 1D's, the activation bytes
against 1D's, and sequence lengths that do not split refused. One spawn per world size."""
from collections import Counter

import pytest

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.core import unsupported
from colab_kit.models import GPT, GPTConfig
from colab_kit.tensor import block_collectives, check_model, plan_class
from colab_kit.tensor.split_gather import SplitGather1D
from colab_kit.tensor.tp1d import Plan1D

from tests.helpers import BATCH, GPT_CFG, OPTIMIZERS, STEPS, assert_params_match

SG = dict(tp_mode="1d", sp_mode="split_gather")
TRAIN = {2: [dict(tp=2)], 4: [dict(tp=4), dict(dp=2, tp=2)]}
COMM_TP = {2: 2, 4: 4}  # the tp of the 1D vs split_gather comparison in each spawn
SKIP_TAGS = ("to_dense",)


def _train(cfgs):
    from colab_kit.tensor.inspect import dense_state

    data, out = SyntheticTokens(64, 16, seed=1), {}
    for kw in cfgs:
        for opt in OPTIMIZERS:
            engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS[opt], ck.ParallelConfig(**kw, **SG))
            assert type(engine.tp_plan) is SplitGather1D  # never plain 1D
            losses = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
            out[tuple(sorted(kw.items())), opt] = losses, dense_state(engine.module)
    return out


def _one_step(kw, n_layers):
    """Last step's tp records (op, tag, bytes, wire) and peak activation bytes of one step."""
    cfg = GPTConfig(**{**GPT_CFG.__dict__, "n_layers": n_layers})
    engine = ck.boost(GPT(cfg), OPTIMIZERS["sgd"], ck.ParallelConfig(**kw))
    engine.train_step(SyntheticTokens(64, 16, seed=1).batch(0, BATCH))
    recs = [(r["op"], r["tag"], r["bytes"], r["wire"]) for r in engine.comm(last_step=True)
            if r["axis"] == "tp" and r["tag"] not in SKIP_TAGS]
    return recs, engine.memory()["activations"], engine.memory_estimate()["activations"]


def _refused_length():
    """A batch of 15 tokens at tp=2: refused at the first step, before any collective of the step."""
    engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS["sgd"], ck.ParallelConfig(tp=2, **SG))
    inputs, targets = SyntheticTokens(64, 16, seed=1).batch(0, BATCH)
    before = len(engine.mesh.log.records)
    try:
        engine.train_step((inputs[:, :15], targets[:, :15]))
        message = None
    except ValueError as exc:
        message = str(exc)
    return message, len(engine.mesh.log.records) - before


def _spawn(world):
    tp = COMM_TP[world]
    steps = {(mode, layers): _one_step(dict(tp=tp, **({"sp_mode": "split_gather"} if mode == "sg" else {})), layers)
             for mode in ("1d", "sg") for layers in (2, 4)}
    return _train(TRAIN[world]), steps, _refused_length() if world == 2 else None


@pytest.fixture(scope="module")
def spawned():
    return {world: ck.launch(_spawn, world, world, timeout=300) for world in (2, 4)}


def test_split_gather_trains_like_one_process(spawned, gpt_references):
    for world, results in spawned.items():
        for rank, (trained, _, _) in enumerate(results):
            assert len(trained) == 2 * len(TRAIN[world])
            for (cfg, opt), (losses, params) in trained.items():
                assert losses == pytest.approx(gpt_references[opt][0], rel=1e-5), (world, rank, cfg, opt)
                assert_params_match(params, gpt_references[opt][1], opt, (world, rank, cfg, opt))


def test_collectives_per_block_are_gather_and_reduce_scatter_with_1d_wire_bytes(spawned):
    """Per block and step (4-layer minus 2-layer, halved): 1D's 4 all-reduces become 2 all-gathers +
    2 reduce-scatters forward and the mirror backward; the wire bytes, each way, equal 1D's. Over the
    whole step the tp traffic equals 1D's except the one flat all-reduce of the gradients that now
    see only this rank's tokens (LayerNorms, row biases, position table)."""
    h, t, b = GPT_CFG.d_model, 16, BATCH
    for world, results in spawned.items():
        n = COMM_TP[world]
        steps = results[0][1]
        per_block = {}
        for mode in ("1d", "sg"):
            two, four = steps[mode, 2][0], steps[mode, 4][0]
            count = lambda recs: Counter((r[0], r[1].split()[-1]) for r in recs)  # (op, direction)  # noqa: E731
            ops = {k: (v - count(two)[k]) / 2 for k, v in count(four).items()}
            wire = {d: (sum(r[3] for r in four if r[1].endswith(d)) - sum(r[3] for r in two if r[1].endswith(d))) / 2
                    for d in ("forward", "backward")}
            per_block[mode] = {k: v for k, v in ops.items() if v}, wire
        assert per_block["1d"][0] == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}
        assert per_block["sg"][0] == {("all_gather", "forward"): 2, ("reduce_scatter", "forward"): 2,
                                      ("reduce_scatter", "backward"): 2, ("all_gather", "backward"): 2}
        both_ways = Counter()
        for (op, _), c in per_block["sg"][0].items():
            both_ways[op] += c
        assert dict(both_ways) == block_collectives(ck.ParallelConfig(tp=n, **SG))
        full = b * t * h * 4  # one [b, t, h] fp32 activation
        assert per_block["1d"][1] == per_block["sg"][1] == {"forward": 2 * 2 * (n - 1) * full / n,
                                                            "backward": 2 * 2 * (n - 1) * full / n}
        # whole step, 2 layers: equal apart from the replicated gradients' sum
        one_d, sg = steps["1d", 2][0], steps["sg", 2][0]
        sums = [r for r in sg if r[1] == "replicated grads"]
        marked = (2 * GPT_CFG.n_layers + 1) * 2 * h + 2 * GPT_CFG.n_layers * h + GPT_CFG.seq_len * h
        assert [(r[0], r[2]) for r in sums] == [("all_reduce", 4 * marked)]
        assert not [r for r in one_d if r[1] == "replicated grads"]
        assert sum(r[3] for r in one_d) == sum(r[3] for r in sg if r[1] != "replicated grads")


def test_split_gather_holds_fewer_activation_bytes_than_1d(spawned):
    """The LayerNorm regions are split: each LayerNorm saves its input [b, t, h] and its mean and
    rstd [b, t] (2 per block and ln_f), whole under 1D and 1/n of it here; everything else saved
    (the gathered inputs of qkv, fc1 and the head, attention, the MLP's inner activations, the
    loss's softmax) is 1D's. So 1D's peak minus ours is exactly (1 - 1/n)(2L + 1)(bth + 2bt) * 4 bytes."""
    h, t, b, L = GPT_CFG.d_model, 16, BATCH, GPT_CFG.n_layers
    for world, results in spawned.items():
        n = COMM_TP[world]
        for rank, (_, steps, _) in enumerate(results):
            one_d, sg = steps["1d", 2][1], steps["sg", 2][1]
            split = (2 * L + 1) * (b * t * h + 2 * b * t) * 4
            assert one_d - sg == split * (n - 1) // n, (world, rank, one_d, sg)
            assert sg < one_d
            est_1d, est_sg = steps["1d", 2][2], steps["sg", 2][2]  # the estimator knows the split too
            assert est_1d - est_sg == split * (n - 1) // n, (world, rank, est_1d, est_sg)


def test_a_sequence_that_does_not_split_is_refused_with_the_multiple(spawned):
    for _, _, (message, records) in spawned[2]:
        assert "a sequence of 15 tokens does not split over tp=2" in message
        assert "use a sequence length that is a multiple of 2" in message
        assert records == 0  # before any collective
    cfg = ck.ParallelConfig(tp=4, **SG)
    odd = GPTConfig(**{**GPT_CFG.__dict__, "seq_len": 18})
    with pytest.raises(ck.ConfigError, match=r"seq_len=18 not divisible by 4: sp_mode='split_gather' .* multiple of 4"):
        check_model(odd, cfg)
    with pytest.raises(ck.ConfigError, match=r"seq_len=18 not divisible by 4"):
        ck.boost(GPT(odd), OPTIMIZERS["sgd"], cfg)  # before any process group
    check_model(odd, ck.ParallelConfig(tp=2, **SG))  # 18 splits over 2


def test_split_gather_is_selected_never_plain_1d_and_refused_off_1d():
    assert plan_class("1d", "split_gather") is SplitGather1D
    assert plan_class("1d", "ring") is Plan1D and plan_class("1d") is Plan1D
    assert unsupported(ck.ParallelConfig(tp=2, **SG)) is None
    assert block_collectives(ck.ParallelConfig(tp=2, **SG)) == {"all_gather": 4, "reduce_scatter": 4}
    off = ck.ParallelConfig(tp=4, tp_mode="2d", sp_mode="split_gather")
    assert "sp_mode='split_gather' with tp_mode='2d'" in unsupported(off)
    with pytest.raises(ck.ConfigError, match="split_gather"):
        ck.boost(GPT(GPT_CFG), OPTIMIZERS["sgd"], off)
    with pytest.raises(ck.ConfigError, match="use tp_mode='1d'"):
        plan_class("2d", "split_gather")

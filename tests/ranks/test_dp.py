"""Data parallelism against one process: same losses (1e-5 relative) and same parameters.

One spawn per world size; inside it every (optimizer, microbatches) case runs in turn.
"""
import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine import parts
from colab_kit.engine.reference import single_process_losses
from colab_kit.models import GPT, GPTConfig

from tests.helpers import BATCH, GPT_CFG, OPTIMIZERS, STEPS
from tests.helpers.matrix import CFG as FOUR_BLOCKS

CASES = [(opt, mb) for opt in OPTIMIZERS for mb in (1, 2)]


def single_process(opt: str):
    torch.manual_seed(123)  # the model must not depend on the global RNG
    return single_process_losses(GPT_CFG, OPTIMIZERS[opt], SyntheticTokens(64, 16, seed=1), STEPS, BATCH)


def train_cases(dp: int):
    """On each rank: every case, returning losses, final parameters, memory and comm."""
    data, out = SyntheticTokens(64, 16, seed=1), {}
    for opt, mb in CASES:
        cfg = ck.ParallelConfig(dp=dp, microbatches=mb)
        engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS[opt], cfg)
        losses = [engine.train_step(data.batch(step, BATCH)) for step in range(STEPS)]
        out[opt, mb] = {"losses": losses, "params": ck.state_vector(engine), "memory": engine.memory(),
                        "comm": engine.comm(last_step=True), "timeline": engine.timeline()}
    return out


@pytest.fixture(scope="module")
def references():
    return {opt: single_process(opt) for opt in OPTIMIZERS}


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_matches_single_process(dp, references):
    results = ck.launch(train_cases, dp, dp)
    for case in CASES:
        ref_losses, ref_params = references[case[0]]
        for rank, res in enumerate(results):
            got = res[case]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (case, rank)
            # Adam turns float noise in a near-zero gradient into a step of up to lr, hence the atol
            torch.testing.assert_close(got["params"], ref_params, rtol=1e-5, atol=5e-5)
            # every rank holds exactly the same parameters, bit for bit
            assert torch.equal(got["params"], results[0][case]["params"]), (case, rank)
        # training moved the weights well past the tolerance, so the match is not trivial
        initial = torch.cat([p.detach().reshape(-1) for p in GPT(GPT_CFG).parameters()])
        assert (ref_params - initial).abs().max() > 100 * 5e-5  # 100x the atol


def test_dp_records_and_memory():
    """Bytes all-reduced per step = gradient bytes + the loss; memory categories measured."""
    results = ck.launch(train_cases, 2, 2)
    n_param_bytes = GPT(GPT_CFG).num_parameters() * 4
    for res in results:
        adam, sgd = res["adamw", 1], res["sgd", 1]
        grad_records = [r for r in adam["comm"] if r["tag"].startswith("grad bucket")]
        assert len(grad_records) >= 2, "the gradients should travel in several buckets"
        assert all(r["op"] == "all_reduce" and r["axis"] == "dp" for r in grad_records)
        assert sum(r["bytes"] for r in grad_records) == n_param_bytes
        assert [r["tag"] for r in adam["comm"] if not r["tag"].startswith("grad")] == ["loss"]
        mem = adam["memory"]
        assert mem["params"] == mem["grads"] == n_param_bytes
        assert 2 * n_param_bytes <= mem["optimizer"] <= 2 * n_param_bytes + 4 * 64  # moments + step counters
        assert sgd["memory"]["optimizer"] == n_param_bytes  # one momentum buffer
        # two microbatches hold half the activations of one at a time
        assert 0 < res["adamw", 2]["memory"]["activations"] < 0.6 * mem["activations"]
        kinds = {e["kind"] for e in adam["timeline"]}
        assert kinds == {"compute", "comm"}
    # dp=2 holds about half the activations of dp=1
    single = ck.launch(train_cases, 1, 1)[0]["adamw", 1]["memory"]["activations"]
    assert results[0]["adamw", 1]["memory"]["activations"] < 0.6 * single


def test_unimplemented_modes_are_refused_before_any_process():
    model = GPT(GPT_CFG)
    for cfg, word in [(ck.ParallelConfig(sp=2, tp=4, tp_mode="2d"), r"sequence parallelism \(sp=2\) with tp_mode='2d'"),
                      (ck.ParallelConfig(pp=2, zero=3), "ZeRO stage 3 with pipeline parallelism"),
                      (ck.ParallelConfig(zero=3, offload="auto"), r"device_budget=BYTES")]:
        with pytest.raises(ck.ConfigError, match=word):
            ck.boost(model, OPTIMIZERS["sgd"], cfg)


def test_batch_that_does_not_split_is_refused():
    def run():
        engine = ck.boost(GPT(GPT_CFG), OPTIMIZERS["sgd"], ck.ParallelConfig(dp=2))
        x, y = SyntheticTokens(64, 16).batch(0, 5)
        try:
            engine.train_step((x, y))
        except ValueError as exc:
            return str(exc)
    messages = ck.launch(run, 2)
    assert all("5 rows does not split over dp=2" in m and "multiple of 2" in m for m in messages)


def test_gpt_is_deterministic_and_shaped():
    a, b = GPT(GPT_CFG), GPT(GPT_CFG)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(GPT(GPTConfig(**{**GPT_CFG.__dict__, "seed": 1})).head.weight, a.head.weight)
    assert a(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 64)
    assert len(a.blocks) == GPT_CFG.n_layers
    with pytest.raises(ValueError, match="divisible by n_heads"):
        GPTConfig(d_model=30, n_heads=4)


def _start_from_other_seeds(bucket_bytes):
    """On each rank: a GPT built with this rank's own seed, boosted under dp=2 zero=1 with the start-up bucket at
    ``bucket_bytes``; its parameters before and after ``boost``, and the start-up broadcasts."""
    parts.INIT_BUCKET_BYTES = bucket_bytes
    rank = torch.distributed.get_rank()
    model = GPT(GPTConfig(**{**FOUR_BLOCKS.__dict__, "seed": rank}))
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    engine = ck.boost(model, OPTIMIZERS["adamw"], ck.ParallelConfig(dp=2, zero=1))
    sent = [r for r in engine.comm() if r["tag"] == "init params"]
    return before, ck.state_vector(engine), [(r["op"], r["bytes"]) for r in sent]


def test_every_rank_starts_from_rank_0s_weights_in_a_few_bucketed_broadcasts():
    """Ranks that built their model from different seeds start training from rank 0's weights, several parameters
    per broadcast, none larger than the largest parameter (the start-up peak grows by one parameter at most); with
    ``INIT_BUCKET_BYTES`` at 1 KiB, smaller buckets (a larger parameter alone), the same start. The model is
    ``colab_kit.engine.parts._broadcast``'s worked example: the 4-block test GPT."""
    sizes = [p.numel() * 4 for p in GPT(FOUR_BLOCKS).parameters()]
    for cap in (32 << 20, 1 << 10):
        (before0, after0, sent0), (before1, after1, sent1) = ck.launch(_start_from_other_seeds, 2, cap)
        assert not torch.equal(before0, before1)                  # the ranks did build different weights
        assert torch.equal(after0, before0) and torch.equal(after1, before0), cap
        assert sent0 == sent1 and {op for op, _ in sent0} == {"broadcast"} and sum(b for _, b in sent0) == sum(sizes)
        if cap > max(sizes):  # a bucket as large as the largest parameter: 53 parameters in 15 broadcasts
            assert max(b for _, b in sent0) == max(sizes) and len(sent0) < len(sizes) / 3
            assert (len(sizes), len(sent0)) == (53, 15)
        else:  # 1 KiB buckets: more of them, every one that holds several parameters within 1 KiB
            assert len(sent0) > len(sizes) / 3 and all(b <= cap or b in sizes for _, b in sent0)

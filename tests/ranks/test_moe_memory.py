"""The memory estimate of a mixture of experts under expert parallelism against ``engine.memory()`` (tier 2):
the MoE GPT of ``tests/helpers/moe.py`` on dp=4 with ep=2 and ep=4 and ZeRO 0 to 3, and under 1D tp and sp (ring,
Ulysses) with ep folded over dp x sp, under selective and per-op recomputation and with offload, one spawn of 4
ranks.
On every rank the estimate (``memory.experts.moe_estimate``, what ``engine.memory_estimate()`` and ``ck.plan``
report) gives the parameters exactly (dense + E/ep experts per MoE layer), the gradients and optimizer states
within 1% (ZeRO shards the dense states over dp, the experts' over edp = dp/ep), and the activations within
12% (measured 0.89-1.02: the dispatch buffers follow each rank's routing; the estimate assumes balanced routing). Under 1D tp the MoE layers run whole on every tp rank: their
router, shared and routed experts are not divided by tp (attention, embeddings and head are), and their
activations are those of all of the (dp, sp) shard's tokens; under sp a rank routes ``seq / sp`` tokens of a row.
Measured (fp32, bytes per rank): dp=2 tp=2 ep=2 params 80,256 estimated 80,256, activations 298,808 to 323,608
estimated 302,212; dp=2 sp=2 ep=4 activations 176,756 to 199,156 against 180,292 (not splitting the tokens over
sp, dp=2 ep=2 of the same batch, estimates 344,196; dividing the experts by tp, params 76,032)."""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.memory.estimator import config_estimate
from colab_kit.memory.experts import expert_params
from colab_kit.models.moe import moe_blocks
from tests.helpers.moe import BATCH, MODELS, OPTIMIZERS, build, data

CONFIGS = [dict(dp=4, ep=2), dict(dp=4, ep=4, zero=1), dict(dp=4, ep=2, zero=2), dict(dp=4, ep=4, zero=2),
           dict(dp=4, ep=2, zero=1, recompute="full"), dict(dp=4, ep=2, zero=3),
           # 1D tp: the MoE layers whole on every tp rank; sp (ring, Ulysses): T / sp tokens a rank, ep over dp x sp
           dict(dp=2, tp=2, ep=2), dict(dp=2, tp=2, ep=2, zero=2), dict(tp=2, sp=2, ep=2, zero=1),
           dict(dp=2, sp=2, ep=4), dict(dp=2, sp=2, sp_mode="ulysses", ep=2, zero=1),
           dict(dp=2, sp=2, ep=2, recompute="full"),
           # per-op recomputation: the router's logits and the shared expert's second matmul kept, the rest again
           dict(dp=4, ep=2, recompute="op"), dict(dp=2, tp=2, ep=2, recompute="op"),
           dict(dp=2, sp=2, ep=2, recompute="op"), dict(dp=4, ep=4, recompute="selective"),
           # offload: the experts' states over edp on the host beside the dense ones over dp
           dict(dp=4, ep=2, zero=1, offload="cpu"), dict(dp=4, ep=4, zero=2, offload="cpu", precision="bf16"),
           dict(dp=4, ep=2, zero=3, offload="cpu")]
KEYS = ("params", "grads", "optimizer", "activations")
STATES = ("params", "grads", "optimizer")
HEAD_TP = 5  # 1D tp all-reduces outside the blocks: the token table's forward, the head's backward, the loss's
#             max and sums, and the step's loss


def _measure(configs: list[dict]) -> list[tuple[dict, dict, int]]:
    out = []
    for kw in configs:
        engine = ck.boost(build("softmax"), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(**kw))
        engine.train_step(data().batch(0, BATCH))
        m, e = engine.memory(), engine.memory_estimate()
        records = engine.comm(last_step=True)
        a2a = {axis: sum(r["op"] == op and r["axis"] == axis for r in records)
               for axis, op in (("ep", "all_to_all"), ("tp", "all_reduce"))}
        out.append(({k: m[k] for k in KEYS} | {"host": dict(m["host"])}, {k: e[k] for k in KEYS} | {
            "host": dict(e["host"])}, a2a))
        engine.close()
    return out


@pytest.fixture(scope="module")
def measured():
    return ck.launch(_measure, 4, CONFIGS, timeout=600)


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_the_estimate_is_the_measurement_on_every_rank(measured, i):
    kw = CONFIGS[i]
    for rank, per in enumerate(measured):
        got, est, _ = per[i]
        assert est["params"] == got["params"], (kw, rank, got, est)
        assert est["grads"] == pytest.approx(got["grads"], rel=0.01), (kw, rank, got, est)
        assert est["optimizer"] == pytest.approx(got["optimizer"], rel=0.01), (kw, rank, got, est)
        # per-op keeps nothing that follows the routing: within 2% (dp=4 ep=2: 69,284 B measured, 68,484
        # estimated, the same 800 B apart as under full recomputation), where an estimate that kept the MoE
        # layers' routed terms whole gives 113,796 B (1.6x)
        tol = 0.02 if kw.get("recompute") == "op" else 0.12
        assert est["activations"] == pytest.approx(got["activations"], rel=tol), (kw, rank, got, est)


@pytest.mark.parametrize("i", [i for i, kw in enumerate(CONFIGS) if kw.get("offload")])
def test_offload_puts_the_states_where_the_estimate_says(measured, i):
    """ep with offload: ZeRO 1-2 the optimizer's states (dense over dp, experts over edp) on the host, ZeRO-3
    every model state; the estimate's host bytes are the measured ones within 1%, and nothing else is there."""
    kw = CONFIGS[i]
    on_host = ("optimizer",) if kw["zero"] < 3 else STATES
    for rank, per in enumerate(measured):
        got, est, _ = per[i]
        for k in STATES:
            if k in on_host:
                assert got["host"][k] > 0 and est["host"][k] == pytest.approx(got["host"][k], rel=0.01), (kw, rank, k)
            else:
                assert got["host"][k] == est["host"][k] == 0, (kw, rank, k)


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_the_at_scale_price_counts_the_all_to_alls_a_step_runs(measured, i):
    """``price``'s ``collectives["ep"]``: a MoE block's counts, dispatch and combine forward and two transposes
    backward, the forward three again under full and per-op recomputation (colab_kit's all-to-all is c10d's
    in-place op: nothing to keep). The check can fail: "op" priced as "none" counts 10 where the engine runs 16.
    Under 1D tp (without sp) its ``collectives["tp"]``: an MoE block's attention all-reduces, proj's forward and
    qkv's backward, and proj's again under full and per-op recomputation (3 a block under "op", which was priced
    as 2.5); the engine runs ``HEAD_TP`` more, the token table's and the vocab-parallel loss's, which the price
    leaves out of its count."""
    from colab_kit.planner.cluster.price import price
    from colab_kit.planner.shape import ModelShape
    kw = CONFIGS[i]
    priced = price(ModelShape.of(MODELS["softmax"]), ck.ParallelConfig(**kw), BATCH, "8xH100-SXM").collectives
    for rank, per in enumerate(measured):
        assert per[i][2]["ep"] == priced.get("ep", 0), (kw, rank, per[i][2], priced)
        if kw.get("tp", 1) > 1 and kw.get("sp", 1) == 1:
            assert per[i][2]["tp"] == priced["tp"] + HEAD_TP, (kw, rank, per[i][2], priced)


def test_the_experts_are_counted_split_over_ep():
    """The check can fail: without the experts (the dense count of the same widths) or with every expert on
    every rank, the parameters are off by at least a rank's experts."""
    moe = MODELS["softmax"]
    for ep in (2, 4):
        est = config_estimate(moe, ck.ParallelConfig(dp=4, ep=ep), BATCH)
        whole = config_estimate(moe, ck.ParallelConfig(dp=4, ep=1), BATCH)
        experts = len(moe_blocks(moe)) * moe.n_experts * expert_params(moe)
        assert whole["params"] - est["params"] == 4 * experts * (ep - 1) // ep


def test_experts_are_whole_on_every_tp_rank_and_tokens_split_over_sp():
    """The check can fail: under dp=2 tp=2 ep=2 a rank holds the dense parameters split by tp but for the MoE
    layers' router and shared expert, and 2 of 4 experts of each MoE layer whole; under sp=2 its activations are
    those of half of a row's tokens (dp=4's and the attention's output copied back to the sequence layout), not of
    whole rows (dp=2's)."""
    from colab_kit.memory.experts import moe_stage_params
    moe = MODELS["softmax"]
    [(dense, experts)] = moe_stage_params(moe, ck.ParallelConfig(dp=2, tp=2, ep=2))
    assert experts == len(moe_blocks(moe)) * moe.n_experts // 2 * expert_params(moe)  # not divided by tp
    assert config_estimate(moe, ck.ParallelConfig(dp=2, tp=2, ep=2), BATCH)["params"] == 4 * (dense + experts)
    from colab_kit.memory.saves import BlockSaves
    sp, dp4, whole = (config_estimate(moe, ck.ParallelConfig(**kw), BATCH)["activations"]
                      for kw in (dict(dp=2, sp=2, ep=2), dict(dp=4, ep=2), dict(dp=2, ep=2)))
    copies = moe.n_layers * BlockSaves.of_gpt(moe).sp_copies(BATCH // 2 * moe.seq_len // 2, 4)  # output copied back
    assert sp == pytest.approx(dp4 + copies, rel=0.01) and whole > 1.9 * sp


def test_dry_run_of_ep_at_scale_gives_the_estimates_model_states():
    """``ck.dry_run`` of a rank of 128 (a fresh process in torch's fake group: boost builds that rank's shards,
    the optimizer's states made): dp=64 x pp=2, ep=16 (edp 4), ZeRO-1, an MoE GPT with dense and MoE blocks. Its
    exact params and grads equal the estimate's; its optimizer differs only by AdamW's 4-byte step counters."""
    from colab_kit.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=1024, seq_len=256, d_model=256, n_heads=8, n_layers=8, n_experts=16, top_k=2,
                    d_expert=256, shared_experts=1, moe_every=2)
    config = ck.ParallelConfig(dp=64, pp=2, ep=16, zero=1, microbatches=2)
    reports = ck.planner.dry_runs.run.dry_run_many(
        [{"model": GPT(cfg, device="meta"), "config": config, "rank": r, "batch": 256} for r in (5, 77)], hardware=())
    for report in reports:
        pp = ck.MeshLayout(config).coords(report.rank)["pp"]
        est = config_estimate(cfg, config, 256, pp_rank=pp)
        assert report.memory["params"] == est["params"] and report.memory["grads"] == est["grads"], report
        tensors = len([n for n, _ in GPT(cfg, device="meta").named_parameters()])
        assert 0 <= report.memory["optimizer"] - est["optimizer"] <= 4 * tensors, report
    assert reports[0].memory["params"] != reports[1].memory["params"]  # the stages hold different blocks


def test_plan_exact_dry_runs_what_the_engine_runs_and_keeps_the_estimate_of_the_rest():
    """``ck.plan(..., exact=2)`` of an MoE GPT on 16 H100s: in fp32 the first two candidates are dry-run and their
    exact parameters (and the estimated activations) are the estimate's for the same pipeline stage, the dry runs'
    fullest; in bf16 likewise (the engine runs ep in 16 bits too)."""
    from colab_kit.models import GPTConfig
    # wide enough that the GPU's work, not the host's dispatch, sets the step (the host floor ties small models)
    cfg = GPTConfig(vocab_size=1024, seq_len=1024, d_model=1024, n_heads=8, n_layers=8, n_experts=16, top_k=2,
                    d_expert=1024, shared_experts=1, moe_every=2)
    from colab_kit.memory.estimator import config_estimate

    def same_stage(c):  # the dry runs' fullest rank against the estimate of that rank's stage
        full = max(c.dry_runs, key=lambda r: sum(r.memory[k] for k in ("params", "grads", "optimizer", "activations")))
        stage = full.rank // (c.config.world_size // c.config.pp)
        est = config_estimate(cfg, c.config, 64, pp_rank=stage)
        return c.memory["params"] == est["params"] and c.memory["activations"] == est["activations"]

    fp32 = ck.plan(cfg, 16, 64, precision="fp32", hardware="8xH100-SXM", exact=2, limit=4)
    exact = [c for c in fp32 if c.dry_runs]
    assert len(exact) == 2 and any(c.config.ep > 1 for c in exact)
    assert all(same_stage(c) for c in exact)
    bf16 = ck.plan(cfg, 16, 64, precision="bf16", hardware="8xH100-SXM", exact=1, limit=3)
    exact16 = [c for c in bf16 if c.dry_runs]  # the engine runs ep in bf16 too: dry-run like fp32
    assert len(exact16) == 1 and all(same_stage(c) for c in exact16)


def _zero_bubble(_):
    import dataclasses

    from colab_kit.models import GPT
    cfg = dataclasses.replace(MODELS["softmax"], n_layers=4)  # a stage a block under zb-v
    out = {}
    for schedule, m in (("zb-h1", 4), ("zb-v", 4)):
        for recompute in (False, True):
            kw = dict(pp=2, microbatches=m, schedule=schedule, chunks=2 if schedule == "zb-v" else 1,
                      recompute=recompute)
            torch.manual_seed(0)
            engine = ck.boost(GPT(cfg), OPTIMIZERS["sgd"], ck.ParallelConfig(**kw))
            engine.train_step(data().batch(0, BATCH))
            out[schedule, recompute] = engine.memory()["activations"], engine.memory_estimate()["activations"]
            engine.close()
    return out


def test_zero_bubble_weight_stores_of_moe_blocks_are_counted():
    """Under zb-h1 and zb-v an MoE block's I leaves its W what its split Linears keep (``moe_block_store``:
    attention's, the router's and the shared expert's inputs and output gradients; the routed experts' weight
    gradients come in I): with full recomputation the stores are the peak. The MoE GPT (a shared expert, top-2 of
    4, 4 blocks), pp=2, 4 microbatches: the estimate 0.97-1.00 of every rank, but zb-h1's first stage under
    recomputation (18,688 B measured, 1,536 B more: the token ids, which the meter counts as the whole batch's
    storage); asserted within 3% and 2 KiB. Left out, the stores made zb-v's first rank under recomputation 0.50."""
    runs = ck.launch(_zero_bubble, 2, None, timeout=300)
    for rank, res in enumerate(runs):
        for key, (got, est) in res.items():
            print(rank, key, got, est, round(est / got, 3))  # pytest -s: the figures the docstring quotes
            assert abs(est - got) <= 0.03 * got + 2048, (rank, key, got, est, est / got)

"""Hugging Face mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V3, GPT-OSS) under the
engine: 3 steps with AdamW and with SGD(momentum=0.9) equal one process within 1e-5 (fp32) under dp=2, dp=2 ep=2,
dp=4 ep=4, dp=4 ep=2, ep x ZeRO 1/2 (with microbatches) and 3, pp with HF's load-balancing loss over every stage's layers (1F1B with ep, and with ep x tp; zb-h1 with recomputation, zb-v with a
stage pair per rank; its counts ride the pipeline's messages, whose bytes are checked), 1D tp
(alone and with ep) and sp (ring, Ulysses; ep folded over dp x sp). The reference is plain torch on the HF model:
``lm_loss(out.logits, y) + router_aux_loss_coef * out.aux_loss`` of ``model(x, output_router_logits=True)``, HF's
own aux loss. Each rank holds E/ep experts; ``engine.save`` at ep=2 loads into dp=2 (ep=1); the dense state dict and
``save_pretrained`` at ep=2 equal the trained reference, and ``engine.generate`` at ep=2 equals the saved model
generating in one process. Bad input is a ConfigError before any process starts. One spawn per world size, the
configs looped inside."""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.checkpoint.pretrained import dense_state_dict
from colab_kit.engine.loss import lm_loss
from colab_kit.engine.reference import max_relative_difference
from colab_kit.expert import HFExpertParallel
from colab_kit.policy import policy_for
from tests.helpers.hf_moe import build, reference
from tests.helpers.moe import BATCH, OPTIMIZERS, RTOL, STEPS, data

PP = dict(pp=2, schedule="1f1b", microbatches=2)
CONFIGS = {  # name: (world, model, optimizer, ParallelConfig kwargs)
    "mixtral dp=2": (2, "mixtral", "sgd", dict(dp=2)),
    "mixtral dp=2 ep=2": (2, "mixtral", "adamw", dict(dp=2, ep=2)),
    "mixtral dp=2 ep=2 sgd": (2, "mixtral", "sgd", dict(dp=2, ep=2)),
    "qwen3 dp=2 ep=2": (2, "qwen3", "sgd", dict(dp=2, ep=2)),
    "qwen2 dp=2 ep=2": (2, "qwen2", "adamw", dict(dp=2, ep=2)),
    "olmoe dp=2 ep=2": (2, "olmoe", "sgd", dict(dp=2, ep=2)),
    "deepseek dp=2 ep=2": (2, "deepseek", "sgd", dict(dp=2, ep=2)),
    "gptoss dp=2 ep=2": (2, "gptoss", "sgd", dict(dp=2, ep=2)),
    "mixtral dp=2 zero=3": (2, "mixtral", "adamw", dict(dp=2, zero=3)),
    "qwen3 dp=2 ep=2 zero=3": (2, "qwen3", "sgd", dict(dp=2, ep=2, zero=3)),  # the experts a chunk over edp
    "olmoe dp=2 ep=2 recompute": (2, "olmoe", "sgd", dict(dp=2, ep=2, recompute="full")),
    "mixtral tp=2": (2, "mixtral", "sgd", dict(tp=2)),  # 1D: every tp rank routes the same tokens
    "qwen3 tp=2": (2, "qwen3", "adamw", dict(tp=2)),  # its dense first layer's MLP split as a Llama's
    "qwen3 sp=2 ring": (2, "qwen3", "adamw", dict(sp=2)),
    "deepseek sp=2 ulysses": (2, "deepseek", "adamw", dict(sp=2, sp_mode="ulysses")),
    "mixtral dp=4 ep=4": (4, "mixtral", "sgd", dict(dp=4, ep=4)),
    "olmoe dp=4 ep=2 zero=1": (4, "olmoe", "adamw", dict(dp=4, ep=2, zero=1)),
    "qwen3 dp=4 ep=4 zero=2 mb=2": (4, "qwen3", "sgd", dict(dp=4, ep=4, zero=2, microbatches=2)),
    "deepseek dp=2 ep=2 pp=2": (4, "deepseek", "sgd", dict(dp=2, ep=2, **PP)),
    "mixtral dp=2 ep=2 pp=2": (4, "mixtral", "adamw", dict(dp=2, ep=2, **PP)),
    "olmoe pp=2 zb-h1 recompute": (2, "olmoe", "sgd", dict(pp=2, schedule="zb-h1", microbatches=2, recompute="full")),
    "mixtral4 dp=2 pp=2 zb-v": (4, "mixtral4", "sgd", dict(dp=2, pp=2, schedule="zb-v", chunks=2, microbatches=2)),
    "mixtral dp=2 tp=2 pp=2 ep=2": (8, "mixtral", "adamw", dict(dp=2, tp=2, ep=2, **PP)),  # ep x tp x pp at once
    "gptoss dp=4 ep=2 zero=1": (4, "gptoss", "adamw", dict(dp=4, ep=2, zero=1)),
    "qwen2 dp=2 ep=2 tp=2": (4, "qwen2", "sgd", dict(dp=2, ep=2, tp=2)),
    "mixtral dp=2 sp=2 ep=4": (4, "mixtral", "adamw", dict(dp=2, sp=2, ep=4)),
    "deepseek dp=2 sp=2 ep=2 ring": (4, "deepseek", "sgd", dict(dp=2, sp=2, ep=2)),  # MLA: d_qk 12, d_v 8
    "mixtral dp=4 ep=2 bf16": (4, "mixtral", "sgd", dict(dp=4, ep=2, precision="bf16")),
}
SAVED = "mixtral dp=2 ep=2 sgd"  # saved at ep=2, loaded at dp=2; its dense weights against the reference's
PROMPT = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))


def _run(names: list[str], path: str) -> dict:
    out = {}
    for name in names:
        _, model, opt, kw = CONFIGS[name]
        engine = ck.boost(build(model), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
        d = data()
        losses = [engine.train_step(d.batch(s, BATCH)) for s in range(STEPS)]
        layers = [m for m in engine.module.modules() if isinstance(m, HFExpertParallel)]
        out[name] = {"losses": losses, "experts": [(m.first, tuple(m.gate_up_proj.shape)) for m in layers],
                     "records": engine.records[0].get("moe"),
                     "pp": [(r["op"], r["tag"], r["bytes"]) for r in engine.comm(last_step=True) if r["axis"] == "pp"]}
        if name == SAVED:
            out[name]["dense"] = dense_state_dict(engine)
            out[name]["evaluated"] = engine.evaluate(d.batch(STEPS, BATCH))
            out[name]["generated"] = engine.generate(PROMPT, 6)
            ck.save_pretrained(engine, path + "-hf")
            engine.save(path)
            other = ck.boost(build(model), OPTIMIZERS[opt], ck.ParallelConfig(dp=2))
            other.load(path)
            out[name]["loaded"] = dense_state_dict(other)
            out[name]["next"] = [other.train_step(d.batch(STEPS, BATCH)), engine.train_step(d.batch(STEPS, BATCH))]
            other.close()
        engine.close()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_moe") / "ckpt")


@pytest.fixture(scope="module")
def runs(saved):
    got = {}
    path = saved
    for world in sorted({c[0] for c in CONFIGS.values()}):
        names = [n for n, c in CONFIGS.items() if c[0] == world]
        for rank, res in enumerate(ck.launch(_run, world, names, path, timeout=600)):
            for name, r in res.items():
                got[name, rank] = r
    return got


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_moe_trains_like_one_process(runs, name):
    """fp32 within 1e-5; bf16 against one process running the same recipe within ``precision.TOLERANCE``."""
    world, model, opt, kw = CONFIGS[name]
    want, _ = reference(model, opt, kw.get("microbatches", 1), dp=kw.get("dp", 1))
    tol = RTOL
    if kw.get("precision", "fp32") != "fp32":
        from colab_kit.precision import TOLERANCE
        from tests.helpers.hf_moe import reference_mixed
        want, tol = reference_mixed(model, opt, kw["precision"], dp=kw.get("dp", 1)), TOLERANCE[kw["precision"]]
        print(f"{name}: {max(max_relative_difference(runs[name, r]['losses'], want) for r in range(world)):.1e}")
    for rank in range(world):
        diff = max_relative_difference(runs[name, rank]["losses"], want)
        assert diff <= tol, (name, rank, diff, runs[name, rank]["losses"], want)
    untrained = [want[0]] * len(want)  # the test can fail: a run that never stepped is far off
    assert max_relative_difference(runs[name, 0]["losses"], untrained) > 1e-3
    if model != "deepseek":  # and a run that dropped the load-balancing loss
        no_aux, _ = reference(model, opt, kw.get("microbatches", 1), dp=kw.get("dp", 1), aux=False)
        assert max_relative_difference(runs[name, 0]["losses"], no_aux) > 1e-3


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c[3].get("ep", 1) > 1])
def test_each_rank_holds_its_experts(runs, name):
    world, model, _, kw = CONFIGS[name]
    n_moe = len(policy_for(build(model)).experts)
    for rank in range(world):
        ep_rank = ck.MeshLayout(ck.ParallelConfig(**kw)).all_coords(rank)["ep"]
        got = runs[name, rank]["experts"]
        assert len(got) == n_moe or kw.get("pp", 1) > 1, got  # a pipeline stage holds its own layers only
        assert all(first == ep_rank * 4 // kw["ep"] and shape[0] == 4 // kw["ep"] for first, shape in got), got


def test_checkpoint_round_trip(runs):
    _, model, opt, _ = CONFIGS[SAVED]
    _, trained = reference(model, opt)
    r = runs[SAVED, 0]
    assert set(r["dense"]) == {k for k in trained if "rotary" not in k}, set(r["dense"]) ^ set(trained)
    for k, v in r["dense"].items():
        assert torch.allclose(v, trained[k], rtol=1e-4, atol=1e-6), k
        assert torch.equal(v, r["loaded"][k]), k
    assert abs(r["next"][0] - r["next"][1]) <= 1e-5 * abs(r["next"][1]), r["next"]


def test_save_pretrained_and_generate_at_ep(runs, saved):
    """``ck.save_pretrained`` at ep=2 writes what ``from_pretrained`` reads as the trained model; ``engine.evaluate``
    and ``engine.generate`` at ep=2 give its cross-entropy and continue a prompt token for token as it does."""
    _, model, opt, _ = CONFIGS[SAVED]
    _, trained = reference(model, opt)
    loaded = type(build(model)).from_pretrained(saved + "-hf").eval()
    for k, v in loaded.state_dict().items():
        assert torch.allclose(v, trained[k], rtol=1e-4, atol=1e-6), k
    x, y = data().batch(STEPS, BATCH)
    with torch.no_grad():  # evaluate: the token loss only, as for the built-in MoE
        ce = float(lm_loss(loaded(x).logits, y))
    assert abs(runs[SAVED, 0]["evaluated"] - ce) <= 1e-5 * ce, (runs[SAVED, 0]["evaluated"], ce)
    want = loaded.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(runs[SAVED, 0]["generated"], want) and torch.equal(runs[SAVED, 1]["generated"], want)


def test_routing_records_equal_one_process(runs):
    """``engine.records[i]["moe"]`` of an HF MoE model: per layer the whole batch's top-k counts (as HF's loss
    takes them), this rank's, the layer's Switch balance and the bytes sent to each ep rank, equal to one
    process's routing of the first step (Mixtral routes with the same top-k of the same softmax)."""
    _, model, _, kw = CONFIGS[SAVED]
    x, _ = data().batch(0, BATCH)
    with torch.no_grad():
        logits = build(model)(x, output_router_logits=True).router_logits
    for layer, lg in enumerate(logits):
        probs = lg.softmax(-1)
        chosen = torch.topk(probs, 2, dim=-1).indices.view(BATCH, -1, 2)
        counts = torch.bincount(chosen.reshape(-1), minlength=4)
        balance = 4 * (counts / (counts.sum()) * probs.mean(0)).sum()
        for rank in range(kw["dp"]):
            rec = runs[SAVED, rank]["records"][layer]
            mine = torch.bincount(chosen.view(kw["dp"], -1)[rank], minlength=4)
            assert rec["layer"] == layer and rec["counts"] == counts.tolist() and rec["mine"] == mine.tolist(), rec
            assert abs(rec["balance"] - float(balance)) <= 1e-5 * float(balance), (rec, float(balance))
            row = 32 * 4  # hidden 32, fp32: each (token, slot) assignment's row to its expert's ep rank (2 each)
            assert rec["sent"] == [int(mine[:2].sum()) * row, int(mine[2:].sum()) * row], rec


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c[3].get("pp", 1) > 1])
def test_counts_ride_the_pipeline_messages(runs, name):
    """With HF's load-balancing loss under pp, every activation or gradient that crosses ranks is followed by one
    side message of its microbatch's per-layer counts, ``[L, E + 2]`` float32 (docs/moe.md), and nothing else is
    added; a model without the loss (DeepSeek-V3 here) sends none."""
    world, model, _, _ = CONFIGS[name]
    n_layers = len(policy_for(build(model)).experts)
    loss_on = model != "deepseek"
    for rank in range(world):
        p2p = [(op, tag, b) for op, tag, b in runs[name, rank]["pp"] if op in ("send", "recv")]
        main = sorted((op, tag) for op, tag, _ in p2p if not tag.endswith((" side", " shape")))
        side = [(op, tag[:-len(" side")], b) for op, tag, b in p2p if tag.endswith(" side")]
        assert main, p2p
        assert sorted((op, tag) for op, tag, _ in side) == (main if loss_on else []), (rank, p2p)
        assert all(b == n_layers * (4 + 2) * 4 for *_, b in side), side

"""ck.dry_run: one rank of a config built under the fake process group, in a fresh process.

1. Configs that also run here (dp x tp, dp x pp, ZeRO-3, ZeRO-2 with tp in bf16, ZeRO-2 with pp): each dry run
   reports the params / grads / optimizer bytes that the real run's ``engine.memory()`` reports on that
   rank after one real step (to the byte, device and host), and the activations that the real engine's
   ``memory_estimate()`` gives for that batch; another rank's, another config's and the dense model's
   bytes fail the same comparison.
2. Two ranks of a 512-rank config (dp=8 x tp=8 x pp=8) of a 406M GPT, in seconds, against
   ``estimate.rank_params`` and the per-block formula; the presets are labelled as assumptions.
3. Bad input is a ConfigError before any process starts; a failing or slow dry run names its rank.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import colab_kit as ck
from colab_kit.planner.cluster.hardware import HARDWARE
from colab_kit.planner.dry_runs.run import DryRunTimeout, dry_run, dry_run_many
from colab_kit.memory.estimator import rank_params
from colab_kit.models import GPT, GPTConfig

SMALL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
BATCH = 8
CONFIGS = [dict(dp=2, tp=2), dict(dp=2, pp=2, microbatches=2), dict(dp=4, zero=3),
           dict(dp=2, tp=2, zero=2, precision="bf16"), dict(dp=2, pp=2, microbatches=2, zero=2, schedule="gpipe")]
STATES = ("params", "grads", "optimizer")


def _real(configs):
    """On each rank: one real train_step per config; memory() and the activation estimate after it."""
    torch.manual_seed(0)
    x = torch.randint(0, SMALL.vocab_size, (BATCH, SMALL.seq_len))
    out = []
    for kw in configs:
        engine = ck.boost(GPT(SMALL), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ck.ParallelConfig(**kw))
        engine.train_step((x, x.roll(-1, 1)))
        mem = engine.memory()
        out.append({**{k: mem[k] for k in STATES}, "device": {k: mem["device"][k] for k in STATES},
                    "host": {k: mem["host"][k] for k in STATES},
                    "activations": engine.memory_estimate()["activations"]})
        engine.close()
    return out


def _mismatch(report, real) -> list[str]:
    """What differs between a dry run's report and a real rank's memory (empty: the same to the byte)."""
    mem = report.memory
    bad = [k for k in STATES if mem[k] != real[k]]
    bad += [f"{side}.{k}" for side in ("device", "host") for k in STATES if mem[side][k] != real[side][k]]
    return bad + (["activations"] if mem["activations"] != real["activations"] else [])


@pytest.fixture(scope="module")
def small_runs():
    t0 = time.perf_counter()
    dry = dry_run_many([dict(model=GPT(SMALL, device="meta"), config=ck.ParallelConfig(**kw), rank="all",
                             batch=BATCH) for kw in CONFIGS], hardware=["8xA100-80GB"])
    t1 = time.perf_counter()
    real = ck.launch(_real, 4, CONFIGS)
    print(f"dry runs of {len(dry)} ranks: {t1 - t0:.1f} s; real runs: {time.perf_counter() - t1:.1f} s")
    assert [(r.config, r.rank) for r in dry] == [(ck.ParallelConfig(**kw), r) for kw in CONFIGS for r in range(4)]
    return {(i // 4, r.rank): r for i, r in enumerate(dry)}, real


def test_dry_run_equals_real_run_to_the_byte(small_runs):
    dry, real = small_runs
    assert len(dry) == 4 * len(CONFIGS)
    assert not dist.is_initialized()  # the caller's process joined no process group
    for (i, rank), report in dry.items():
        assert _mismatch(report, real[rank][i]) == [], (CONFIGS[i], rank, report.memory, real[rank][i])
        assert report.coords == ck.MeshLayout(report.config).coords(rank)
        assert all(rank in g for g in report.groups.values())
    zero3 = dry[(2, 1)].memory
    assert zero3["params"] < 4 * sum(p.numel() for p in GPT(SMALL).parameters()) // 3  # sharded: about a quarter


def test_the_comparison_rejects_wrong_answers(small_runs):
    dry, real = small_runs
    pp = CONFIGS.index(dict(dp=2, pp=2, microbatches=2))
    assert _mismatch(dry[(pp, 0)], real[2][pp])  # pipeline rank 0 (embeddings) against rank 2 (the head)
    assert _mismatch(dry[(0, 0)], real[0][pp])  # dp x tp's rank 0 against dp x pp's
    assert _mismatch(dry[(2, 0)], real[0][3])  # ZeRO-3 against ZeRO-2 bf16
    dense = sum(p.numel() for p in GPT(SMALL).parameters())
    whole = {"params": 4 * dense, "grads": 4 * dense, "optimizer": 8 * dense, "activations": 0,
             "device": {"params": 4 * dense, "grads": 4 * dense, "optimizer": 8 * dense},
             "host": dict.fromkeys(STATES, 0)}
    assert set(_mismatch(dry[(0, 0)], whole)) >= {"params", "grads", "optimizer"}  # the dense model's bytes


WIDE = GPTConfig(vocab_size=8192, seq_len=16, d_model=128, n_heads=4, n_layers=1)  # a table of 1 << 20 elements
WIDE_RUNS = [(dict(dp=2), "adamw"), (dict(dp=2, zero=1), "sgd-momentum"), (dict(dp=2, zero=2), "adam")]
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3), "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
              "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)}


def _wide_real():
    torch.manual_seed(0)
    x = torch.randint(0, WIDE.vocab_size, (4, WIDE.seq_len))
    out = []
    for kw, opt in WIDE_RUNS:
        engine = ck.boost(GPT(WIDE), OPTIMIZERS[opt], ck.ParallelConfig(**kw))
        engine.train_step((x, x.roll(-1, 1)))
        mem = engine.memory()
        out.append({**{k: mem[k] for k in STATES}, "device": {k: mem["device"][k] for k in STATES},
                    "host": {k: mem["host"][k] for k in STATES}, "activations": engine.memory_estimate()["activations"]})
        engine.close()
    return out


def test_the_first_step_on_tensors_it_does_not_compute_makes_the_real_states():
    """Tensors of ``child.BIG`` elements or more (the token table, ZeRO's flat buffers) get their optimizer
    states in a dry run without any value computed (``_unwritten(stepping=True)``): AdamW, Adam and SGD with
    momentum, plain dp, ZeRO-1 and ZeRO-2, each to the byte of a real rank after one real step."""
    from colab_kit.planner.dry_runs.child import BIG as UNWRITTEN_FROM

    assert max(p.numel() for p in GPT(WIDE, device="meta").parameters()) >= UNWRITTEN_FROM  # the path is taken
    dry = dry_run_many([dict(model=GPT(WIDE, device="meta"), config=ck.ParallelConfig(**kw), rank=1, batch=4,
                             optimizer=opt) for kw, opt in WIDE_RUNS], hardware=[])
    real = ck.launch(_wide_real, 2)[1]
    for (kw, opt), report, mine in zip(WIDE_RUNS, dry, real):
        assert _mismatch(report, mine) == [], (kw, opt, report.memory, mine)
    assert _mismatch(dry[0], real[1]) and _mismatch(dry[1], real[2])  # and the comparison can fail


BIG = GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_heads=16, n_layers=24)  # 406M parameters


def test_512_ranks_from_this_machine(tmp_path, monkeypatch):
    import importlib

    from colab_kit.planner import EXAMPLE_CONSTANTS
    from colab_kit.planner.local.constants import VERSION, cache_path
    monkeypatch.setenv("COLAB_KIT_CACHE", str(tmp_path))  # "this machine": constants from a cache, not measured
    os.makedirs(os.path.dirname(cache_path()), exist_ok=True)
    with open(cache_path(), "w") as fh:  # of this VERSION (an entry of another is measured again)
        json.dump({"4": {**EXAMPLE_CONSTANTS, "version": VERSION}}, fh)

    def measure(ranks):
        raise AssertionError(f"constants measured on {ranks} ranks where the cache had them")
    monkeypatch.setattr(importlib.import_module("colab_kit.planner.local.constants"), "measure", measure)
    cfg = ck.ParallelConfig(dp=8, tp=8, pp=8, microbatches=8)
    t0 = time.perf_counter()
    first, middle = dry_run(GPT(BIG, device="meta"), cfg, rank=[37, 200], batch=64,
                            hardware=["8xA100-80GB", "8xH100-SXM", "this machine"])
    elapsed = time.perf_counter() - t0  # printed below, not asserted: how fast is the machine's to say
    assert first.seconds > 0 and middle.seconds > 0
    assert first.coords == {"pp": 0, "dp": 4, "sp": 0, "tp": 5} and middle.coords["pp"] == 3
    assert {a: len(g) for a, g in first.groups.items()} == {"pp": 8, "dp": 8, "sp": 1, "tp": 8}
    assert first.groups["tp"] == list(range(32, 40)) and first.groups["pp"] == [37 + 64 * i for i in range(8)]
    for rep in (first, middle):
        n = rank_params(BIG, cfg, rep.coords["pp"])
        tensors = 36 + 2 * (rep.coords["pp"] == 0)  # 3 blocks of 12 tensors; the first stage's two tables
        assert rep.n_params == n
        assert rep.memory["params"] == rep.memory["grads"] == 4 * n
        assert rep.memory["optimizer"] == 8 * n + 4 * tensors  # AdamW's two fp32 moments, a 4-byte step each
        assert rep.memory["activations"] == rep.estimate["activations"] > 0
    h, blocks = BIG.d_model, 24 * 12 * BIG.d_model ** 2 + 24 * 13 * BIG.d_model
    block = blocks // 24  # a middle stage: 3 blocks cut over tp=8, their LayerNorms and two biases (6h) whole
    assert middle.n_params == 3 * ((block - 6 * h) // 8 + 6 * h)
    assert abs(middle.n_params - blocks / (8 * 8)) < 0.01 * blocks / 64  # about total / (tp * pp)
    text = str(first)
    assert "rank 37 of 512" in text and "tp 8 [32..39]" in text
    for name in ("8xA100-80GB", "8xH100-SXM"):
        assert 0 < first.step_seconds[name] < 10 and first.fits[name]
        assert "assumed" in text and HARDWARE[name].source in text and "datasheet" in HARDWARE[name].source
    assert first.step_seconds["8xH100-SXM"] < first.step_seconds["8xA100-80GB"]
    assert first.step_seconds["this machine"] > 0 and "measured on this machine" in first.hardware["this machine"]
    assert "<pre>" in first._repr_html_()
    assert not dist.is_initialized()
    print(f"512-rank dry run of ranks 37 and 200: {elapsed:.1f} s ({first.seconds:.2f} s, {middle.seconds:.2f} s)")


def test_bad_input_is_refused_before_any_process(monkeypatch):
    def no_process(*a, **k):
        raise AssertionError("a process was started for bad input")
    monkeypatch.setattr(subprocess, "run", no_process)
    model = GPT(SMALL, device="meta")
    cases = [(dict(config=ck.ParallelConfig(dp=2, tp=2), rank=4), "0..3"),
             (dict(config=ck.ParallelConfig(dp=2, tp=2), rank=-1), "0..3"),
             (dict(config=ck.ParallelConfig(dp=2, tp=2), rank=[0, 9]), "0..3"),
             (dict(config=ck.ParallelConfig(tp=3)), "tp"),  # 4 heads do not split over 3
             (dict(config=ck.ParallelConfig(dp=2), batch=3), "multiple of 2"),
             (dict(config=ck.ParallelConfig(pp=3)), "3"),  # 4 layers over 3 stages
             (dict(config=ck.ParallelConfig(dp=2, zero=3, offload="auto")), "offload='cpu'"),
             (dict(config=ck.ParallelConfig(dp=2), optimizer="lion"), "adamw"),
             (dict(config=ck.ParallelConfig(dp=2), hardware=["TPU"]), "8xH100-SXM"),
             (dict(config={"dp": 2}), "ParallelConfig")]
    for kw, says in cases:
        with pytest.raises(ck.ConfigError, match=None) as err:
            dry_run(model, **kw)
        assert says in str(err.value), (kw, str(err.value))
    with pytest.raises(ck.ConfigError) as err:
        dry_run(model, ck.ParallelConfig(tp=3))
    assert "n_heads=4" in str(err.value) or "heads" in str(err.value)


def test_a_failing_or_slow_dry_run_names_its_rank():
    model = GPT(SMALL, device="meta")
    with pytest.raises(ck.RankError) as err:  # the optimizer factory raises inside the dry-run process
        dry_run(model, ck.ParallelConfig(dp=2, tp=2), rank=3, optimizer=int, hardware=[])
    text = str(err.value)
    assert "rank 3 failed" in text and "TypeError" in text and "dp=2 x tp=2" in text
    with pytest.raises(DryRunTimeout) as err:  # its optimizer factory sleeps: the child is killed at the timeout
        dry_run(model, ck.ParallelConfig(dp=2, tp=2), rank=1, hardware=[], timeout=1.5, optimizer=_slow_optimizer)
    assert "rank 1" in str(err.value) and "1.5 s" in str(err.value)
    assert not dist.is_initialized()


def test_a_dry_run_is_forked_from_a_warm_server_not_a_new_interpreter(tmp_path):
    """``launch.warm.fork_call`` (what a dry run runs in): the child is not ours but the forkserver's, and starts
    with the engine's modules imported; a target that raises exits 1 with its traceback in the log. A new
    interpreter (before: 3.5 s for a small GPT's dry run here, 0.07 s of it the dry run) has neither."""
    from colab_kit.launch.warm import fork_call

    out, log = tmp_path / "facts.json", str(tmp_path / "log")
    assert fork_call("tests.helpers.warm_probe:facts", [str(out)], log).wait(60) == 0
    facts = json.loads(out.read_text())
    assert facts["parent"] != os.getpid() and facts["warm"] == ["torch._dynamo", "colab_kit.engine.core"], facts
    assert fork_call("tests.helpers.warm_probe:fail", ["no such shard"], log).wait(60) == 1
    assert "ValueError: no such shard" in open(log, encoding="utf-8").read()


def test_a_script_that_dry_runs_outside_a_main_guard_runs_once(tmp_path):
    """The child runs a module's function and never imports the caller's main module: a script that calls
    ``ck.dry_run`` at its top level is not run again in it (multiprocessing would import it, and the dry run
    inside that import would fail: a process started while the child is still bootstrapping)."""
    script = tmp_path / "plan_it.py"
    script.write_text("import colab_kit as ck\nfrom colab_kit.models import GPTConfig\nprint('script ran', flush=True)\n"
                      "cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)\n"
                      "print(ck.dry_run(cfg, ck.ParallelConfig(dp=2, tp=2), rank=3, hardware=[]).n_params)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("script ran") == 1 and done.stdout.splitlines()[-1].isdigit(), done.stdout


def _dry_run_in_a_rank():
    return ck.dry_run(SMALL, ck.ParallelConfig(dp=2, tp=2), rank=3, hardware=[]).memory


def test_a_rank_of_launch_dry_runs_in_a_new_interpreter():
    """A rank of ``ck.launch`` is a daemonic process, which multiprocessing lets fork no child: its dry run
    starts a new interpreter, as every dry run did before, with the same report."""
    [inside] = ck.launch(_dry_run_in_a_rank, 1)
    assert inside == dry_run(SMALL, ck.ParallelConfig(dp=2, tp=2), rank=3, hardware=[]).memory


def _slow_optimizer(params):
    time.sleep(600)
    return torch.optim.SGD(params, lr=0.1)


def test_a_dry_run_gives_big_tensors_storage_and_writes_no_value():
    """``_unwritten``: under it a fill or a copy into a tensor of ``BIG`` elements or more touches no page
    (64 MiB of zeros and a copy into them leave this process's resident memory within 16 MiB), the storage
    and its bytes are there; small tensors are written as usual. The same fill outside it is resident
    (the check can fail)."""
    import psutil

    from colab_kit.planner.dry_runs.child import BIG as big_numel, _unwritten
    proc, n = psutil.Process(), 16 << 20  # 64 MiB of fp32
    src = torch.ones(n)
    with _unwritten():
        torch.zeros(8)  # the first op under a dispatch mode imports its machinery (about 70 MiB, once)
        before = proc.memory_info().rss
        big = torch.zeros(n)
        big.copy_(src)
        twin = torch.zeros_like(src)
        grown = proc.memory_info().rss - before
        small, fill = torch.zeros(8), torch.full((4,), 3.0)
        small.fill_(2.0)
        kinds = [torch.full((n,), v).dtype for v in (5, True, 0.5)]  # the dtype a fill value implies, kept
    assert big.numel() == twin.numel() == n and big.untyped_storage().nbytes() == 4 * n >= 4 * big_numel
    assert grown < 16 << 20, grown
    assert small.tolist() == [2.0] * 8 and fill.tolist() == [3.0] * 4
    assert kinds == [torch.int64, torch.bool, torch.get_default_dtype()]
    del big, twin
    before = proc.memory_info().rss
    real = torch.zeros(n)
    assert proc.memory_info().rss - before > 48 << 20 and real.sum().item() == 0.0


def test_plan_at_scale_ranks_by_dry_runs():
    """ck.plan for 512 ranks on a preset: the first candidates' model states replaced by their dry runs'
    exact bytes (the fullest pipeline stage), marked in the table; refused without constants."""
    cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_heads=8, n_layers=8)
    with pytest.raises(ck.ConfigError, match="512 local processes: pass hardware="):
        ck.plan(cfg, 512, 512)
    with pytest.raises(ck.ConfigError, match="unknown hardware 'H100'"):
        ck.plan(cfg, 512, 512, hardware="H100")
    cands = ck.plan(cfg, 512, 512, hardware="8xH100-SXM", exact=2, limit=6)
    assert cands.memory_per_rank == HARDWARE["8xH100-SXM"].usable_bytes  # the allocator overheads left out
    exact = [c for c in cands if c.exact]
    assert len(exact) == 2 and "* model states exact" in cands.table()
    from colab_kit.memory.estimator import config_estimate
    for c in exact:
        cfg_ = c.config
        ranks = [s * (cfg_.world_size // cfg_.pp) for s in range(cfg_.pp)]
        assert [r.rank for r in c.dry_runs] == ranks and all(r.config == cfg_ for r in c.dry_runs)
        fullest = max(c.dry_runs, key=lambda r: sum(r.memory[k] for k in STATES) + r.memory["activations"])
        assert {k: c.memory[k] for k in STATES} == {k: fullest.memory[k] for k in STATES}  # the rank's, to the byte
        stage = fullest.rank // (cfg_.world_size // cfg_.pp)
        est = config_estimate(cfg, cfg_, 512, "adamw", pp_rank=stage)
        assert c.memory["activations"] == est["activations"] == fullest.memory["activations"]  # the same rank's
        assert c.memory["optimizer"] > est["optimizer"]  # the estimate leaves out AdamW's step counters
        assert c.device_bytes == sum(c.memory["device"].values())

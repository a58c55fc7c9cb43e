"""%colossal / %%colossal through a real IPython shell (tier 3)."""
from __future__ import annotations

import re
import time

import pytest

import colab_kit as ck
from colab_kit.notebook.cluster import Cluster


@pytest.fixture
def state(ip):
    s = ck.magics.state(ip)
    s.cluster, s.config, s.last, s.recorded = None, None, None, []
    yield s
    if s.cluster is not None and s.cluster.running and not getattr(s.cluster, "_shared", False):
        s.cluster.stop()  # a cluster this test started (and left behind when it failed)
    s.cluster, s.config = None, None


@pytest.fixture
def shared(state, cluster):
    """The session cluster adopted by the magics (never stopped by them)."""
    cluster._shared = True
    state.cluster = cluster
    return cluster


def _usage(run, src: str, *needles: str) -> str:
    error, out, err = run(src)
    assert type(error).__name__ == "UsageError", (src, error, out, err)
    text = out + err
    for needle in needles:
        assert needle in text, (src, needle, text)
    assert "Traceback" not in text
    return text


def test_bad_input_without_a_cluster(run, state):
    _usage(run, "%colossal strat", "unknown subcommand 'strat'", "did you mean 'start'?", "stop, restart")
    _usage(run, "%colossal start --bogus 3", "%colossal start: unrecognized arguments: --bogus 3",
           "[-n N] [--fit] [--engines ENGINES]")
    _usage(run, "%colossal start -n four", "argument -n: invalid int value: 'four'")
    _usage(run, "%colossal start -n 0", "argument -n: must be a positive whole number, got '0'")
    _usage(run, "%colossal start --timeout 0", "argument --timeout: must be a number of seconds > 0, got '0'")
    _usage(run, "%colossal start --engines slurmm", "unknown engine launcher engines='slurmm'", "slurm")
    _usage(run, "%colossal status --verbose", "%colossal status: unrecognized arguments: --verbose")
    _usage(run, "%colossal config dp=4 tpp=2", "unknown config key 'tpp'", "did you mean 'tp'?")
    _usage(run, "%colossal config --dp", "flag --dp needs a value")
    _usage(run, "%colossal config tp=6 tp_mode=2d", "tp=6 with tp_mode='2d' needs tp to be a square (q*q): try 4 or 9")
    _usage(run, "%colossal mesh", "no config to draw", "%colossal mesh dp=2 tp=2")
    _usage(run, "%colossal mesh --axis tp_row dp=2", "unknown axis 'tp_row'", "this mesh has axes pp, dp, sp, tp")
    _usage(run, "%colossal mesh --axs tp dp=2", "unknown config key 'axs'", "Usage: %colossal mesh [--axis AXIS]")
    for src in ("%colossal stop", "%colossal restart", "%%colossal\nprint(rank)", "%colossal timeline"):
        _usage(run, src, "no cluster started: run %colossal start -n 4 first")
    assert state.cluster is None and state.config is None


def test_help_status_config_and_mesh_need_no_cluster(run, ip, state):
    error, out, _ = run("%colossal")
    assert error is None and "%colossal start [-n N]" in out and "%%colossal [--ranks 0,2]" in out
    error, out, _ = run("%colossal status")
    assert error is None and "no cluster running" in out
    error, out, _ = run("%colossal config --dp 2 --tp 2")
    assert error is None and "kept in the kernel" in out
    assert state.config == ck.ParallelConfig(dp=2, tp=2)
    error, _, _ = run("fig = %colossal mesh")
    fig = ip.user_ns["fig"]
    assert error is None and [list(t.customdata) for t in fig.data] == [[0, 1], [2, 3]]
    error, _, _ = run("fig = %colossal mesh --axis dp pp=2 tp=2")  # inline words win over the set config
    assert error is None and [list(t.customdata) for t in ip.user_ns["fig"].data] == [[0], [1], [2], [3]]


def test_config_checks_the_world_size_before_touching_the_engines(run, state, shared):
    error, out, _ = run("%colossal config dp=4")
    assert error is None and "config set on 4 ranks: dp=4 = 4 ranks" in out
    assert shared.config == state.config == ck.ParallelConfig(dp=4)
    _usage(run, "%colossal config dp=2", "needs dp*pp*sp*tp = 2*1*1*1 = 2 ranks, but there are 4", "try dp=4")
    assert [o.stdout for o in shared.execute("print(config.dp)").values()] == ["4\n"] * 4
    assert state.config == ck.ParallelConfig(dp=4)
    error, out, _ = run("%colossal status")
    assert error is None and "4 ranks (local engines, nccl_rules); config: dp=4 = 4 ranks" in out


def test_cell_runs_on_every_rank_with_output_grouped(run, state, shared):
    run("%colossal config dp=2 tp=2")
    error, out, _ = run("%%colossal\nprint(rank, mesh.ranks('tp'))\nrank * 10")
    assert error is None
    assert out.index("[rank 0]\n0 [0, 1]\nOut[rank 0]: 0") < out.index("[rank 3]\n3 [2, 3]\nOut[rank 3]: 30")
    assert sorted(state.last) == [0, 1, 2, 3] and state.last[2].stdout == "2 [2, 3]\n"
    error, out, _ = run("%%colossal\nprint(config.describe())")
    assert error is None and out == "[ranks 0, 1, 2, 3]\ndp=2 x tp=2 (1d) = 4 ranks\n"
    error, out, _ = run("%%colossal --ranks 0,2\nprint('only', rank)")
    assert error is None and out == "[rank 0]\nonly 0\n[rank 2]\nonly 2\n"
    _usage(run, "%%colossal --rank 1\nprint(rank)", "%%colossal: unrecognized arguments: --rank 1")


@pytest.mark.parametrize("src, needle", [
    ("%%colossal --ranks '0,\nprint(rank)",
     "%%colossal: cannot split \"--ranks '0,\" into words: No closing quotation"),
    ("%%colossal --ranks 0,x\nprint(rank)", "argument --ranks: expected comma-separated ranks like 0,2, got '0,x'"),
    ("%%colossal --ranks ,\nprint(rank)", "argument --ranks: expected comma-separated ranks like 0,2, got ','"),
    ("%%colossal --ranks 0,-1\nprint(rank)", "argument --ranks: ranks are numbered from 0, got '0,-1'"),
    ("%%colossal --ranks 9\nprint(rank)", "ranks [9] are not ranks of this cluster: choose among 0..3"),
    ("%%colossal --timeout -1\nprint(rank)", "argument --timeout: must be a number of seconds > 0, got '-1'"),
    ("%%colossal --timeout 0\nprint(rank)", "argument --timeout: must be a number of seconds > 0, got '0'"),
    ("%%colossal --timeout soon\nprint(rank)", "argument --timeout: invalid float value: 'soon'"),
    ("%colossal start -n 0", "argument -n: must be a positive whole number, got '0'"),
    ("%colossal start --engines ssh --hosts a:2,b:x", "argument --hosts: expected host:engines pairs like "
                                                      "10.0.0.1:2,10.0.0.2:2 (each host once"),
    ("%colossal config dp=2 dp=4", "config key 'dp' given twice, as dp=2 and as dp=4: give it once"),
    ("%colossal config dp=4 --dp 4", "config key 'dp' given twice, as dp=4 and as --dp 4: give it once"),
])
def test_bad_flags_are_usage_errors_that_leave_the_cluster_usable(run, state, shared, src, needle):
    _usage(run, src, needle)
    assert state.cluster is shared and state.config is None and shared.config is None
    error, out, _ = run("%%colossal --ranks 0,3\nprint('still here', rank)")
    assert error is None and out == "[rank 0]\nstill here 0\n[rank 3]\nstill here 3\n"
    assert shared.status() == "4 ranks (local engines, nccl_rules); config: none set"


def test_help_documents_every_subcommand_and_flag(run, ip, state):
    from colab_kit.notebook.magics.flags import CELL_FLAGS, COMMANDS, FLAGS, help_text

    doc = ip.find_line_magic("colossal").__doc__
    assert doc == ip.find_cell_magic("colossal").__doc__ == help_text()
    error, out, _ = run("%colossal?")
    assert error is None and help_text().splitlines()[2] in out
    for name, (flags, _, text) in COMMANDS.items():
        assert f"%colossal {name}" in doc and text in doc
        for flag in flags:
            assert all(f in doc for f in FLAGS[flag][0]) and FLAGS[flag][1]["help"] in doc
    assert "%%colossal [--ranks 0,2] [--timeout S]" in doc and all(FLAGS[f][1]["help"] in doc for f in CELL_FLAGS)


def test_dash_h_shows_one_subcommand_and_does_nothing_else(run, state, shared):
    from colab_kit.notebook.magics.flags import COMMANDS, help_text

    for name, (_, _, text) in COMMANDS.items():
        for flag in ("-h", "--help"):
            error, out, _ = run(f"%colossal {name} {flag}")
            if name == "help":  # help's help is the whole help
                assert error is None and out == help_text() + "\n"
                continue
            assert error is None and out.startswith(f"usage: %colossal {name}") and text in out, (name, out)
    error, out, _ = run("%colossal start -n 2 -h")  # not started: the cluster is still the shared one
    assert error is None and re.search(r"--engines ENGINES +ipyparallel launcher", out), out
    assert re.search(r"--hosts A:2,B:2 +engines per host for --engines ssh", out), out
    error, out, _ = run("%colossal config dp=4 -h")
    assert error is None and "config words: key=value or --key value, keys: dp, tp" in out
    assert run("%colossal stop -h")[0] is None and state.cluster is shared and shared.running
    assert state.config is None and shared.config is None
    error, out, _ = run("%colossal help schedule")
    assert error is None and out.startswith("usage: %colossal schedule [--pp P] [-m M]")
    assert "-m M, --microbatches M" in out
    error, out, _ = run("%%colossal -h\nraise SystemExit('the cell must not run')")
    assert error is None and out.startswith("usage: %%colossal [--ranks 0,2] [--timeout S]") and state.last is None
    assert "--timeout S  seconds before giving up" in out


def test_cell_timeout_returns_and_reports_the_running_ranks(run, shared):
    """The cell returns at its timeout while the ranks still sleep (the next cell is refused: still running),
    and the cluster takes cells again once they are done."""
    t0 = time.monotonic()
    error, out, err = run("%%colossal --timeout 0.3\nimport time\ntime.sleep(4)")
    assert isinstance(error, ck.RankTimeout)
    assert "[ranks 0, 1, 2, 3] still running" in out and "did not finish within 0.3 s" in out + err
    _usage(run, "%%colossal\nprint(rank)", "still running a call that timed out")
    while "still running a call that timed out" in shared.status():
        assert time.monotonic() - t0 < 60, shared.status()
        time.sleep(0.05)
    error, out, _ = run("%%colossal --ranks 1\nprint(rank)")
    assert error is None and out == "[rank 1]\n1\n"


def test_a_kernel_variable_used_on_the_ranks_is_named_as_the_kernels(run, shared):
    """``NameError`` on the ranks for a name this kernel defines: the magic says the cell runs in the ranks' own
    namespace (a plain NameError read as a typo); a name the kernel lacks too gets no such hint."""
    run("KERNEL_ONLY = 3")
    error, out, err = run("%%colossal\nprint(KERNEL_ONLY)")
    assert isinstance(error, ck.RankError)
    assert "'KERNEL_ONLY' is a variable of this kernel, not of the ranks: a %%colossal cell runs in each rank's " \
        "own namespace" in err, err
    error, out, err = run("%%colossal\nprint(NOWHERE)")
    assert isinstance(error, ck.RankError) and "NameError: name 'NOWHERE'" in out + err
    assert "is a variable of this kernel" not in err


def test_ctrl_c_in_a_cell_shows_every_ranks_output_and_the_health_check(run, shared):
    import _thread
    import threading

    threading.Timer(1.5, _thread.interrupt_main).start()
    error, out, err = run("%%colossal\nimport time\nprint('working on', rank, flush=True)\ntime.sleep(1000)")
    assert isinstance(error, KeyboardInterrupt)
    assert error._render_traceback_() == ["CellInterrupted: the cell was interrupted on every rank (what each "
                                          "printed, and the cluster's check, are above)"]  # not 56 lines of frames
    for r in range(4):
        assert f"[rank {r}] interrupted\nworking on {r}\n" in out
    assert "interrupted; cluster: 4 ranks" in err and "NEEDS RESTART" not in err
    error, out, _ = run("%%colossal --ranks 2\nprint(rank)")
    assert error is None and out == "[rank 2]\n2\n"


def test_lifecycle_start_fail_restart_stop_start_again(run, state):
    error, out, _ = run("%colossal start -n 2")
    assert error is None, out
    assert "started 2 ranks (local engines, nccl_rules)" in out
    pids = [row["pid"] for row in state.cluster.ranks()]
    for pid in pids:
        assert str(pid) in out
    _usage(run, "%colossal start -n 2", "already running")
    run("%colossal config dp=2")

    cell = ("%%colossal\nimport torch, torch.distributed as dist\nprint('before', rank)\n"
            "if rank == 1:\n    raise ValueError('rank one is unhappy')\ndist.all_reduce(torch.ones(1))\n")
    t0 = time.monotonic()
    error, out, err = run(cell)
    assert time.monotonic() - t0 < state.cluster.grace + 30  # the grace, not a hang in the all_reduce
    assert isinstance(error, ck.RankError) and error.rank == 1 and error.stuck == [0]
    text = out + err
    assert "[rank 0] still running" in text and "[rank 1] FAILED" in text and "before 1" in text
    assert "ValueError: rank one is unhappy" in text and "----> 4" in text  # the rank's own traceback
    assert "RankError: rank 1 failed in %%colossal" in text and "run %colossal restart" in text
    assert "site-packages/IPython" not in text  # no kernel-side traceback dump
    _usage(run, "%%colossal\nprint(rank)", "needs a restart", "%colossal restart")
    error, out, _ = run("%colossal status")
    assert "NEEDS RESTART" in out

    error, out, _ = run("%colossal restart")
    assert error is None and "restarted 2 ranks" in out and "with config dp=2 = 2 ranks" in out
    error, out, _ = run("%%colossal\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
                        "dist.all_reduce(t)\nprint(t.item(), mesh.ranks('dp'))")
    assert error is None and out == "[ranks 0, 1]\n2.0 [0, 1]\n"

    old = state.cluster
    error, out, _ = run("%colossal stop")
    assert error is None and "cluster stopped" in out and not old.running and state.cluster is None
    _usage(run, "%%colossal\nprint(rank)", "no cluster started")
    error, out, _ = run("%colossal start -n 2")
    assert error is None and "started 2 ranks" in out
    error, out, _ = run("%%colossal\nprint(rank, config.describe())")  # the kept config came back
    assert error is None and out == "[rank 0]\n0 dp=2 = 2 ranks\n[rank 1]\n1 dp=2 = 2 ranks\n"
    run("%colossal stop")

    run("%colossal config dp=2 tp=2")  # kept for 4 ranks; 2 start: dropped, so config and mesh show the ranks'
    error, out, _ = run("%colossal start -n 2")
    assert error is None and "the kept config (dp=2 x tp=2 (1d) = 4 ranks) does not fit 2 ranks and was " \
        "dropped: set one with %colossal config" in out, out
    error, out, _ = run("%colossal config")
    assert out.startswith("no config set"), out
    error, out, err = run("%%colossal\nimport torch, colab_kit as ck\n"
                          "ck.boost(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), config)")
    assert "boost needs a ck.ParallelConfig, got None: pass one, e.g. ck.ParallelConfig(dp=4); in a %%colossal " \
        "cell `config` is the cluster's" in out + err, out + err
    run("%colossal stop")


def test_state_works_without_ipython():
    s = ck.magics.ColossalState()
    with pytest.raises(ck.cluster.ClusterError, match="no cluster started"):
        s.require_cluster()
    assert "kept in the kernel" in s.apply_config(ck.ParallelConfig(dp=2))
    assert s.mesh_config([]) == ck.ParallelConfig(dp=2)
    assert s.mesh_config(["tp=4"]) == ck.ParallelConfig(tp=4)
    assert isinstance(Cluster, type)


def test_schedule_plans_in_the_kernel(run, ip, state):
    error, out, _ = run("fig = %colossal schedule --pp 4 --microbatches 8 --schedule interleaved --chunks 2")
    assert error is None, out
    assert "interleaved, pp=4, microbatches=8, chunks=2 (planned" in out and "bubble 15.8% of rank time" in out
    assert "textbook (p-1)/(m+p-1) = 27.3%; this schedule's (p-1)/(v*m+p-1) = 15.8%" in out
    assert "peak activations held per rank: 11, 9, 7, 5 microbatches of one chunk" in out
    fig = ip.user_ns["fig"]
    labels = {label for t in fig.data for label in t.text}
    assert {"0F0", "7B7", "4F3"} <= labels and len(labels) == 2 * 8 * 8
    assert "planned timeline (simulated)" in fig.layout.title.text
    error, out, _ = run("%colossal schedule -m 4 --schedule zb-h1")  # pp defaults to 4
    assert error is None and "zb-h1, pp=4, microbatches=4" in out and "held until the W pass" in out
    run("%colossal config pp=2 microbatches=4 schedule=gpipe")  # the kept config fills what is not given
    error, out, _ = run("%colossal schedule")
    assert error is None and out.startswith("gpipe, pp=2, microbatches=4 (planned") and "peak" in out
    error, out, _ = run("%colossal schedule --schedule interleaved")  # interleaved picks chunks=2
    assert error is None and "interleaved, pp=2, microbatches=4, chunks=2" in out
    _usage(run, "%colossal schedule --schedule interleaved --chunks 1", "needs chunks > 1", "try --chunks 2")
    _usage(run, "%colossal schedule --pp 4 --schedule interleaved -m 6", "needs microbatches divisible by pp=4",
           "try --microbatches 4 or 8")
    _usage(run, "%colossal schedule --schedule zb", "unknown schedule 'zb'", "'zb-h1'")
    _usage(run, "%colossal schedule --pp two", "argument --pp: invalid int value: 'two'")
    _usage(run, "%colossal schedule --stages 4", "unrecognized arguments: --stages 4")
    assert state.cluster is None


def test_timeline_gathers_the_last_step_of_every_rank(run, ip, state, shared):
    _usage(run, "%colossal timeline --var tl_engine", "ranks [0, 1, 2, 3] have no engine in a variable 'tl_engine'",
           "--var NAME")
    run("%colossal config pp=4 microbatches=4")
    error, out, _ = run("%%colossal\nimport torch, colab_kit as ck\nfrom colab_kit.models import GPT, GPTConfig\n"
                        "torch.manual_seed(0)\nmodel = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, "
                        "n_layers=4))\ntl_engine = ck.boost(model, lambda ps: torch.optim.SGD(ps, lr=0.1), config, "
                        "mesh=mesh)")
    assert error is None, out
    _usage(run, "%colossal timeline --var tl_engine", "has not trained a step yet", "tl_engine.train_step(batch)")
    error, out, _ = run("%%colossal\nfrom colab_kit.datasets import SyntheticTokens\n"
                        "loss = tl_engine.train_step(SyntheticTokens(32, 8).batch(0, 8))")
    assert error is None, out
    assert "tl_engine: step 1 · loss " in out and "tokens/s" in out and "MFU" in out, out  # what the cell trained
    error, out, _ = run("%%colossal\nx = 1")
    assert error is None and "tl_engine:" not in out, out  # a cell that trained nothing says nothing
    error, out, _ = run("fig = %colossal timeline --var tl_engine")
    assert error is None, out
    assert "last step of 'tl_engine' on 4 ranks (measured" in out and "rank 3: compute" in out
    assert "pipeline bubble (measured):" in out
    fig = ip.user_ns["fig"]
    labels = {label for t in fig.data for label in t.text}
    assert {"0F0", "3B3", "1RF2", "optimizer step"} <= labels
    assert {"rank 0", "rank 3"} <= set(fig.layout.yaxis.categoryarray) and "measured" in fig.layout.title.text
    assert {t.name for t in fig.data} >= {"F forward", "B backward", "idle"}


def test_a_cell_that_trains_shows_loss_norm_lr_and_speed(run, state, shared):
    """The recipe through %%colossal: the user's optimizer and scheduler, clipping; the line after the cell
    shows the steps it ran, the loss, the last norm (clipped), the lr and the throughput."""
    run("%colossal config dp=4")
    error, out, _ = run("%%colossal\nimport torch, colab_kit as ck\nfrom colab_kit.models import GPT, GPTConfig\n"
                        "from colab_kit.datasets import SyntheticTokens\n"
                        "model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2))\n"
                        "opt, sched = ck.recipe.adamw(model, 3e-3, warmup=2, total=10)\n"
                        "rc_engine = ck.boost(model, opt, config, mesh=mesh, lr_scheduler=sched, max_grad_norm=0.01)\n"
                        "for s in range(3):\n    loss = rc_engine.train_step(SyntheticTokens(32, 8).batch(s, 8))")
    assert error is None, out
    line = next(t for t in out.splitlines() if t.startswith("rc_engine:"))
    assert "steps 1-3 · loss " in line and "(clipped to 0.01)" in line and "lr " in line and "tokens/s" in line, line


def test_a_cell_on_ranks_without_0_asks_rank_0_nothing():
    """The line of what a cell trained is rank 0's answer to a question sent behind the cell; a cell that did
    not run on rank 0 sent none, and no round trip of its own goes out after it."""
    from colab_kit.notebook.magics.training import summary_lines

    class Stub:
        asked = []

        def collect(self, submitted, timeout=None):
            self.asked.append(submitted)
            return [{"name": "e", "first": 1, "last": 2, "loss_first": 3.0, "loss_last": 2.5, "grad_norm": None,
                     "max_grad_norm": None, "lr": None, "skipped": 0, "throughput": None}]

        def run(self, *args, **kwargs):  # a second round trip after the cell
            self.asked.append("run")
            return [self.collect(None)[:0]]

    stub = Stub()
    assert summary_lines(stub, None) == [] and stub.asked == []
    assert summary_lines(stub, (0, "sent")) == ["e: steps 1-2 · loss 3 -> 2.5"] and stub.asked == [(0, "sent")]


def test_export_writes_a_script_that_trains_like_the_notebook_under_torchrun(run, state, shared, tmp_path):
    """%colossal export: the configs and the cells that ran, as a script; run under torchrun it prints the
    losses the notebook's cell printed; with the wrong number of ranks it says so before connecting."""
    import json
    import subprocess
    import sys
    run("%colossal config dp=2 tp=2")
    error, out, _ = run("%%colossal\nimport json, torch, colab_kit as ck\nfrom colab_kit.models import GPT, GPTConfig\n"
                        "from colab_kit.datasets import SyntheticTokens\ntorch.set_num_threads(1)\n"
                        "ex_engine = ck.boost(GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)), "
                        "lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config, mesh=mesh)\n"
                        "ex_losses = [ex_engine.train_step(SyntheticTokens(32, 8, seed=1).batch(s, 8)) for s in range(3)]\n"
                        "if rank == 0:\n    print('LOSSES', json.dumps(ex_losses))")
    assert error is None, out
    notebook = json.loads(out.split("LOSSES ")[1].splitlines()[0])
    error, out, _ = run("%%colossal --ranks 0\n%time y = 2\nprint('only rank 0')")
    assert error is None, out
    _usage(run, "%colossal export", "the following arguments are required: PATH")
    error, out, _ = run(f"%colossal export {tmp_path}/train.py")
    assert error is None, out
    assert "torchrun --nproc-per-node 4 train.py" in out and "sbatch train.sbatch" in out
    assert "IPython lines left as comments" in out and "%time y = 2" in out
    script = (tmp_path / "train.py").read_text()
    assert "ck.init(config)" in script and "if rank in (0,):" in script and "exec(compile(" in script
    assert "srun python train.py" in (tmp_path / "train.sbatch").read_text()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ran = subprocess.run(torchrun + ["--nproc-per-node=4", "train.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    exported = json.loads(ran.stdout.split("LOSSES ")[1].splitlines()[0])
    assert exported == pytest.approx(notebook, rel=1e-5)
    assert ran.stdout.count("only rank 0") == 1
    wrong = subprocess.run(torchrun + ["--nproc-per-node=2", "train.py"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert wrong.returncode != 0
    assert "= 4 ranks, and this job has WORLD_SIZE=2 from torchrun" in wrong.stderr + wrong.stdout


FIT_CELL = """%%colossal --timeout 90
import os, torch, colab_kit as ck
from colab_kit.models import GPT, GPTConfig
fit_engine = ck.boost(GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)),
                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config, mesh=mesh)
x, y = ck.datasets.SyntheticTokens(32, 8, seed=2).batch(0, 32)
loader = fit_engine.loader([(x[i], y[i]) for i in range(32)], 8, seed=0)
def die(eng, loss):
    if {die} and rank == 1 and eng.step_count == {die}:
        os._exit(3)
fit_engine.fit(loader, 6, checkpoint={path!r}, every=2, on_step=die)
if rank == 0:
    print('HISTORY', fit_engine.history)
fit_engine.close()
"""


def test_fit_continues_after_a_dead_engine_and_a_restart(run, state, shared, tmp_path):
    """An engine process killed mid-run (rank 1 at step 3): the cell fails naming it; after %colossal
    restart the same cell continues from the checkpoint of step 2 to the uninterrupted run's losses."""
    import ast
    run("%colossal config dp=4")
    error, out, _ = run(FIT_CELL.format(die=0, path=str(tmp_path / "whole")))
    assert error is None, out
    whole = ast.literal_eval(out.split("HISTORY ")[1].splitlines()[0])
    error, out, err = run(FIT_CELL.format(die=3, path=str(tmp_path / "ck")))
    assert error is not None and "rank 1" in out + err, out + err
    error, out, _ = run("%colossal restart")
    assert error is None, out
    assert ck.checkpoint.check(str(tmp_path / "ck"))["step"] == 2
    error, out, _ = run(FIT_CELL.format(die=0, path=str(tmp_path / "ck")))
    assert error is None, out
    assert ast.literal_eval(out.split("HISTORY ")[1].splitlines()[0]) == pytest.approx(whole, rel=1e-5)


def test_loading_twice_keeps_the_state_and_unloading_removes_everything(ip, state):
    state.config = ck.ParallelConfig(dp=2)
    ck.magics.load_ipython_extension(ip)  # a second load keeps the state (and any cluster)
    assert ck.magics.state(ip) is state
    assert ip.custom_exceptions == ()  # errors render themselves (_render_traceback_): no shell-wide handler
    ip.run_line_magic("unload_ext", "colab_kit")
    assert "colossal" not in ip.magics_manager.magics["line"]
    with pytest.raises(RuntimeError, match="%load_ext colab_kit"):
        ck.magics.state(ip)
    ip.run_line_magic("load_ext", "colab_kit")
    assert ck.magics.state(ip) is not state and ck.magics.state(ip).config is None


def test_progress_line_of_a_long_cell(monkeypatch):
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(("update", repr(obj), obj._repr_html_()))

    def fake_display(obj, display_id=False):
        shown.append(("display", repr(obj), obj._repr_html_()))
        return Handle()

    monkeypatch.setattr(ck.notebook.progress, "display", fake_display)
    progress = ck.notebook.progress.Progress(4)
    progress(1.0, {0: "step 0\n"})  # quick cells show nothing
    assert shown == []
    progress(2.4, {0: "", 1: ""})
    progress(3.6, {0: "step 0\nstep 1  loss <3.1>\n", 1: "step 0\n"})
    progress.close()
    assert shown == [("display", "running on 4 ranks for 2 s", "<code>running on 4 ranks for 2 s</code>"),
                     ("update", "running on 4 ranks for 4 s; rank 0: step 1  loss <3.1>",
                      "<code>running on 4 ranks for 4 s; rank 0: step 1  loss &lt;3.1&gt;</code>"),
                     ("update", "", "")]


def test_a_failing_rank_renders_as_its_message_without_a_kernel_traceback(run, ip):
    ip.user_ns["err"] = ck.RankError({1: "Traceback (most recent call last):\n  in f\nValueError: boom"}, [0], "f",
                                     "run %colossal restart")
    error, out, err = run("raise err")
    text = out + err
    assert isinstance(error, ck.RankError) and "RankError: rank 1 failed in f: ValueError: boom" in text
    assert "--- traceback of rank 1 ---" in text and "----> 1 raise err" not in text and "Cell In[" not in text
    ip.user_ns["err"].shown = True  # the magic printed every rank's traceback already: the summary alone
    error, out, err = run("raise err")
    assert "run %colossal restart" in out + err and "--- traceback of rank" not in out + err


class FakeCluster:
    """Cluster.start / restart with the progress keyword: says how far it got, starts nothing."""
    calls: list = []

    def __init__(self, n=None, engines="local", *, timeout=60, ip=None, hosts=None, fit=False):
        self.world_size, self.engines, self.config, self.running = n, engines, None, True
        self.fit_note = ""

    def _go(self, what, progress):
        FakeCluster.calls.append((what, progress))
        for done in range(self.world_size + 1):
            progress and progress("engines registered", done, self.world_size)
        progress and progress("engines registered", self.world_size, self.world_size)  # unchanged: not redrawn
        progress and progress("torch.distributed ready", self.world_size, self.world_size)
        return self

    def start(self, progress=None):
        return self._go("start", progress)

    def restart(self, progress=None):
        return self._go("restart", progress)

    def ranks(self):
        return [{"rank": r, "backend": "gloo"} for r in range(self.world_size)]

    def stop(self):
        self.running = False


@pytest.fixture
def fake_cluster(monkeypatch):
    import sys

    FakeCluster.calls = []
    monkeypatch.setattr(sys.modules["colab_kit.notebook.session"], "Cluster", FakeCluster)
    return FakeCluster


def test_start_and_restart_show_progress_in_a_notebook(run, ip, state, fake_cluster, monkeypatch):
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(repr(obj))

    def fake_display(obj, display_id=False):
        assert display_id is True
        shown.append(repr(obj))
        return Handle()

    monkeypatch.setattr(ck.notebook.progress, "display", fake_display)
    monkeypatch.setattr(ip, "kernel", object(), raising=False)  # as in a notebook
    error, out, _ = run("%colossal start -n 2")
    assert error is None and "started 2 ranks (local engines, gloo)" in out
    assert [line.rsplit(" (", 1)[0] for line in shown] == [
        "starting the cluster: engines registered 0/2", "starting the cluster: engines registered 1/2",
        "starting the cluster: engines registered 2/2", "starting the cluster: torch.distributed ready 2/2", ""]
    shown.clear()
    error, out, _ = run("%colossal restart")
    assert error is None and "restarted 2 ranks" in out
    assert shown[-2:] == ["restarting the cluster: torch.distributed ready 2/2 (0 s)", ""]
    assert [what for what, progress in fake_cluster.calls] == ["start", "restart"]


def test_start_shows_no_progress_in_a_terminal(run, state, fake_cluster):
    error, out, _ = run("%colossal start -n 2")
    assert error is None and out.startswith("started 2 ranks (local engines, gloo) in 0.0 s\n")
    assert "engines registered" not in out and fake_cluster.calls == [("start", None)]


def test_progress_goes_only_to_a_method_that_takes_it():
    from colab_kit.notebook.session import with_progress

    told = []
    assert with_progress(lambda: "old", told.append) == "old"  # a Cluster without the keyword still starts
    assert with_progress(lambda progress=None: progress, told.append) == told.append
    assert with_progress(lambda progress=None: progress, None) is None


def test_plan_refuses_bad_input_before_planning(run, ip, state):
    ip.user_ns["MODEL"] = ck.models.GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    ip.user_ns["not_a_model"] = 3
    _usage(run, "%colossal plan --batch 8", "the following arguments are required: --model",
           "Usage: %colossal plan --model VAR --batch N [--ranks N] [--memory 64MiB] [--top K]")
    _usage(run, "%colossal plan --model MODEL --batch 8 --memory 64MB",
           "argument --memory: expected bytes like 64MiB, 1.5GiB or 4096 (units B, KiB, MiB, GiB, TiB), got '64MB'")
    _usage(run, "%colossal plan --model MODEL --batch 8 --ranks 2 --memory 0.5KiB",
           "--memory comes to 512 bytes, less than a KiB", "did you mean GiB? e.g. --memory 16GiB")
    _usage(run, "%colossal plan --model MODEL --batch 0", "argument --batch: must be a positive whole number, got '0'")
    _usage(run, "%colossal plan --model MODEL --batch 8 --top 0", "argument --top: must be a positive whole number")
    _usage(run, "%colossal plan --model MODL --batch 8 --ranks 4", "no variable 'MODL' in the kernel",
           "MODL = GPTConfig(")
    _usage(run, "%colossal plan --model not_a_model --batch 8 --ranks 4", "'not_a_model' is a int, not a GPTConfig")
    _usage(run, "%colossal plan --model MODEL --batch 8", "no cluster to take the number of ranks from: give --ranks N")
    error, out, _ = run("%colossal help plan")
    assert error is None and out.startswith("usage: %colossal plan --model VAR --batch N")
    assert "--memory 64MiB" in out and "memory per rank (B, KiB, MiB, GiB)" in out
    assert state.config is None


def test_plan_shows_the_candidates_and_apply_sets_what_config_sets(run, ip, state, shared, monkeypatch):
    from colab_kit import planner
    from colab_kit.viz.planner import config_words
    from colab_kit.notebook.widgets import PlannerView

    monkeypatch.setattr(planner, "constants", lambda ranks=4, refresh=False: planner.EXAMPLE_CONSTANTS)  # no measuring
    ip.user_ns["MODEL"] = ck.models.GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    error, out, _ = run("fig = %colossal plan --model MODEL --batch 8 --memory 1MiB --top 5")  # a terminal
    assert error is None, error
    assert out.startswith("PlannerView: 5 of ") and "best first (planned: estimated, not run); memory per rank 1.00" in out
    assert ip.user_ns["fig"].layout.title.text.startswith("Planned (estimated, not run)")
    monkeypatch.setattr(ip, "kernel", object(), raising=False)  # as in a notebook: the view itself
    error, out, _ = run("view = %colossal plan --model MODEL --batch 8 --top 5")
    view = ip.user_ns["view"]
    assert error is None and isinstance(view, PlannerView) and view.state is state and len(view.candidates) == 5
    assert all(c.config.world_size == 4 for c in view.candidates)  # --ranks defaults to the cluster's 4
    view.select(1)
    message = view.apply()
    assert message == f"config set on 4 ranks: {view.chosen.config.describe()}"
    assert state.config == shared.config == view.chosen.config
    state.config = None
    shared.set_config(None)
    error, out, _ = run(f"%colossal config {config_words(view.chosen.config)}")
    assert error is None and out == message + "\n" and state.config == shared.config == view.chosen.config
    error, out, _ = run("view8 = %colossal plan --model MODEL --batch 8 --ranks 8 --top 3")
    assert error is None and ip.user_ns["view8"].apply().startswith(
        "not applied: this config needs dp*pp*sp*tp = ") and ", but there are 4" in ip.user_ns["view8"].message
    assert state.config == shared.config == view.chosen.config

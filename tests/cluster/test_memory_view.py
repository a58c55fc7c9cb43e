"""MemoryView, %colossal memory and viz.memory: pure figures, the widget on a stand-in cluster,
then the real session cluster (an engine trained a step; what is shown equals engine.memory())."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import colab_kit as ck
from colab_kit.notebook.magics.core import ColossalMagics
from colab_kit.viz import memory_by_rank_figure, memory_figure
from colab_kit.notebook.widgets import MemoryView
from colab_kit.notebook.widgets.memory_view import NoMemory, fmt

MIB = 2**20


def _mem(params: int, host_optimizer: int = 0) -> dict:
    total = {"params": params, "grads": params + 1, "optimizer": 2 * params + 3, "activations": 3 * params + 7}
    host = {"params": 0, "grads": 0, "optimizer": host_optimizer, "activations": 0}
    return {**total, "device": {k: total[k] - host[k] for k in total}, "host": host}


MEASURED = [_mem(1000, host_optimizer=500), _mem(3000)]
ESTIMATED = [_mem(990), _mem(2990)]


# ------------------------------------------------------------------ the pure figure
def test_bars_carry_the_exact_bytes_given_and_the_estimate_is_labelled():
    fig = memory_by_rank_figure(MEASURED, ESTIMATED)
    names = [t.name for t in fig.data]
    assert names == ["params", "grads", "optimizer", "activations", "params (estimated)", "grads (estimated)",
                     "optimizer (estimated)", "activations (estimated)"]
    for t in fig.data:
        kind, cat = ("estimated", t.name.split()[0]) if "(estimated)" in t.name else ("measured", t.name)
        rows = ESTIMATED if kind == "estimated" else MEASURED
        assert list(t.customdata) == [m[cat] for m in rows]
        assert list(t.y) == [m[cat] / MIB for m in rows]
        assert [list(level) for level in t.x] == [["rank 0", "rank 1"], [kind, kind]]
        assert "%{customdata:,} B" in t.hovertemplate and t.legendgroup == kind
    assert fig.layout.barmode == "stack" and fig.layout.yaxis.title.text == "MiB"
    assert "beside the estimate" in fig.layout.title.text and not fig.layout.shapes


def test_by_place_stacks_device_under_host():
    fig = memory_by_rank_figure(MEASURED, ESTIMATED, by="place")
    got = {t.name: list(t.customdata) for t in fig.data}
    assert got == {"device": [sum(m["device"].values()) for m in MEASURED], "host": [500, 0],
                   "device (estimated)": [sum(m["device"].values()) for m in ESTIMATED], "host (estimated)": [0, 0]}
    assert got["device"][0] + got["host"][0] == sum(MEASURED[0][c] for c in ("params", "grads", "optimizer",
                                                                              "activations"))


def test_budget_line_only_with_a_budget():
    assert not memory_by_rank_figure(MEASURED).layout.shapes
    fig = memory_by_rank_figure(MEASURED, ESTIMATED, budget=3 * MIB, by="place")
    (line,) = fig.layout.shapes
    assert (line.name, line.y0, line.y1, line.line.dash, line.xref) == ("device budget", 3.0, 3.0, "dash", "x domain")
    assert fig.layout.annotations[0].text == "device budget 3,145,728 B (3.00 MiB)"


def test_without_an_estimate_one_bar_per_rank_and_memory_figure_is_that():
    fig = memory_by_rank_figure(MEASURED)
    assert [t.name for t in fig.data] == ["params", "grads", "optimizer", "activations"]
    assert list(fig.data[0].x) == ["rank 0", "rank 1"] and list(fig.data[0].customdata) == [1000, 3000]
    old = memory_figure(MEASURED)  # the CLI report's figure: the same bars, its own title
    assert [(t.name, list(t.customdata)) for t in old.data] == [(t.name, list(t.customdata)) for t in fig.data]
    assert old.layout.title.text == "Memory per rank (measured)"
    assert [t.name for t in memory_figure([{"params": 4, "buffers": 2}]).data] == ["params", "buffers"]


def test_bad_input_says_what_to_give():
    with pytest.raises(ValueError, match="by='size': choose 'category' or 'place'"):
        memory_by_rank_figure(MEASURED, by="size")
    with pytest.raises(ValueError, match="by='place' needs 'device' and 'host' in every dict; rank 0 has only"):
        memory_by_rank_figure([{"params": 4}], by="place")
    with pytest.raises(ValueError, match="2 measured ranks but 1 estimates"):
        memory_by_rank_figure(MEASURED, ESTIMATED[:1])


# ------------------------------------------------------------------ the widget on a stand-in cluster
class FakeCluster:
    """``run(fn, var)`` as a Cluster answers ``_rank_memory``: step counts up with every call."""

    running, needs_restart, world_size = True, False, 2

    def __init__(self, budget=None):
        self.calls, self.budget, self.threads = 0, budget, []

    def run(self, fn, var, progress="auto"):
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        return [{"memory": m, "estimate": e, "budget": self.budget, "step": self.calls}
                for m, e in zip(MEASURED, ESTIMATED)]


def test_text_table_outside_a_kernel(capsys):
    view = MemoryView(FakeCluster(budget=8192))
    view._ipython_display_()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "MemoryView('engine' on 2 ranks, step 1; KiB, measured / estimated)"
    assert lines[1].split() == ["rank", "params", "grads", "optimizer", "activations", "device", "host"]
    assert lines[2].split()[:4] == ["0", fmt(1000, 1024), "/", fmt(990, 1024)]
    assert lines[3].split("  ")[1:] and f"{fmt(3 * 3000 + 7, 1024)} / {fmt(3 * 2990 + 7, 1024)}" in lines[3]
    assert lines[-1] == "  device budget: 8,192 B" and view._ui is None
    assert view._repr_mimebundle_() == {"text/plain": out.rstrip("\n")}


def test_widget_toggle_refresh_and_errors():
    cluster = FakeCluster()
    view = MemoryView(cluster, by="place")
    view.widget()
    ui = view._ui
    assert ui["by"].value == "place" and "step 1 on 2 ranks" in ui["status"].value
    assert "no device budget set" in ui["status"].value
    ui["by"].value = "category"
    assert view.by == "category" and [t.name for t in ui["figure"].data][:2] == ["params", "grads"]
    ui["refresh"].click()  # no event loop here: refreshed at once
    assert view.steps == [2, 2] and "step 2 on 2 ranks" in ui["status"].value
    assert "after step 2" in ui["figure"].layout.title.text

    def broken(fn, var, progress="auto"):
        raise RuntimeError("ranks gone")
    cluster.run = broken
    ui["refresh"].click()
    assert view.error == "RuntimeError: ranks gone" and "ranks gone" in ui["errors"].outputs[0]["text"]
    assert not ui["refresh"].disabled and view.steps == [2, 2]  # the last numbers stay


def test_refresh_button_in_a_kernel_gathers_off_the_loop():
    cluster = FakeCluster()
    view = MemoryView(cluster)
    view.widget()

    async def click():
        task = view.click_refresh()
        assert isinstance(task, asyncio.Task) and view._ui["refresh"].disabled
        await task

    asyncio.run(click())
    assert view.steps == [2, 2] and cluster.threads[-1] != threading.current_thread().name
    assert not view._ui["refresh"].disabled


def test_no_engine_or_no_cluster_is_a_clear_error():
    none = SimpleNamespace(running=True, needs_restart=False, run=lambda fn, var, progress=None: [None, {}])
    with pytest.raises(NoMemory, match=r"ranks \[0\] have no engine in a variable 'eng'.*--var NAME"):
        MemoryView(none, var="eng")
    with pytest.raises(NoMemory, match="no cluster to read: start one with %colossal start -n 4"):
        MemoryView(ck.magics.ColossalState())


def test_watch_refreshes_after_colossal_cells_or_every_cell(ip):
    fake = FakeCluster()
    view = MemoryView(fake).watch(ip)
    ip.run_cell("x = 1")
    assert view.watching and view.steps == [1, 1]  # not a %%colossal cell
    view.watch(ip, every_cell=True)  # again: replaces the first registration, not a second one
    ip.run_cell("x = 2")
    assert view.steps == [2, 2]
    ip.run_cell("raise ValueError('a failed cell')")
    assert view.steps == [2, 2]  # skipped
    fake.running = False
    ip.run_cell("x = 3")
    assert view.steps == [2, 2] and view.error is None  # no cluster running: skipped, not an error
    fake.running = True
    view.unwatch()
    ip.run_cell("x = 4")
    assert not view.watching and view.steps == [2, 2]


# ------------------------------------------------------------------ the real cluster
@pytest.fixture
def magics(ip, cluster):
    """The magics on the session cluster (never stopped by them); the engine and watchers removed after."""
    s = ck.magics.state(ip)
    cluster._shared = True
    s.cluster, s.config, s.last = cluster, None, None
    m = ip.magics_manager.registry["ColossalMagics"]
    yield m
    if getattr(m, "_memory_view", None) is not None:
        m._memory_view.unwatch()
    m._memory_view = None
    cluster.execute("if 'mem_engine' in globals():\n    mem_engine.close(); del mem_engine")
    s.cluster, s.config = None, None


def _truth(var: str):
    from colab_kit.notebook.cluster.remote import namespace

    eng = namespace()[var]
    return eng.memory(), eng.memory_estimate(), eng.step_count


def _cell(ip, capsys, src: str):
    capsys.readouterr()
    result = ip.run_cell(src)
    out, err = capsys.readouterr()
    assert result.success, (src, out, err)
    return out


TRAIN = "%%colossal\nmem_engine.train_step(SyntheticTokens(32, 8).batch(mem_engine.step_count, 8))"


def test_memory_magic_and_view_show_every_ranks_engine_memory(ip, capsys, magics, cluster, monkeypatch):
    from IPython.core.error import UsageError

    for src, needle in (("%colossal memory --var mem_engine", "have no engine in a variable 'mem_engine'"),
                        ("%colossal memory --by size", "argument --by: invalid choice: 'size'"),
                        ("%colossal memory extra", "unrecognized arguments: extra")):
        result = ip.run_cell(src)
        assert isinstance(result.error_in_exec, UsageError) and needle in str(result.error_in_exec), src
    _cell(ip, capsys, "%colossal config dp=4 zero=2")
    _cell(ip, capsys, "%%colossal\nimport torch, colab_kit as ck\nfrom colab_kit.models import GPT, GPTConfig\n"
                      "from colab_kit.datasets import SyntheticTokens\ntorch.manual_seed(0)\n"
                      "model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2))\n"
                      "mem_engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), config, mesh=mesh)")
    _cell(ip, capsys, TRAIN)
    truth = cluster.run(_truth, "mem_engine")

    out = _cell(ip, capsys, "fig = %colossal memory --var mem_engine")  # a terminal: the table, then the figure
    assert out.startswith("MemoryView('mem_engine' on 4 ranks, step 1;") and "device budget: none set" in out
    fig = ip.user_ns["fig"]
    for t in fig.data:
        cat, which = t.name.split()[0], 1 if "(estimated)" in t.name else 0
        assert list(t.customdata) == [truth[r][which][cat] for r in range(4)], t.name
    assert not fig.layout.shapes  # no device budget on these engines
    _cell(ip, capsys, "fig = %colossal memory --var mem_engine --by place")
    assert {t.name: list(t.customdata) for t in ip.user_ns["fig"].data}["device"] == \
        [sum(m["device"].values()) for m, _, _ in truth]

    view = MemoryView(cluster, var="mem_engine").refresh()
    assert view.measured == [m for m, _, _ in truth] and view.estimated == [e for _, e, _ in truth]
    assert view.steps == [1] * 4 and view.budget is None

    monkeypatch.setattr(ColossalMagics, "_notebook", True)  # a kernel: the magic returns a view that watches
    _cell(ip, capsys, "view = %colossal memory --var mem_engine")
    shown = ip.user_ns["view"]
    assert isinstance(shown, MemoryView) and shown.watching and shown.steps == [1] * 4
    _cell(ip, capsys, TRAIN)  # refreshed after the %%colossal cell: the new step's numbers
    assert shown.steps == [2] * 4 and shown.measured == [m for m, _, _ in cluster.run(_truth, "mem_engine")]
    _cell(ip, capsys, "view2 = %colossal memory --var mem_engine")
    assert ip.user_ns["view2"].watching and not shown.watching  # one watcher per %colossal memory

    result = ip.run_cell("%colossal memory --timeline --var mem_engine --data no_batch")
    assert "no batch in a variable 'no_batch'" in str(result.error_in_exec)
    assert [s for _, _, s in cluster.run(_truth, "mem_engine")] == [2] * 4  # refused before any rank stepped
    _cell(ip, capsys, "%%colossal\nmem_batch = SyntheticTokens(32, 8).batch(5, 8)")
    out = _cell(ip, capsys, "tfig = %colossal memory --timeline --var mem_engine --data mem_batch")
    peaks = [m["step_peak"] for m, _, _ in cluster.run(_truth, "mem_engine")]
    assert all(p and p > 0 for p in peaks) and out.count(": peak ") == 4, out
    for r, p in enumerate(peaks):
        assert f"rank {r}: peak {p / 1e6:.2f} MB" in out
    marks = [t for t in ip.user_ns["tfig"].data if t.text == ("peak",)]
    assert [m.y[0] for m in marks] == [p / 1e6 for p in peaks]

"""%colossal input that the audit found mishandled: export paths, unloading, --var naming no engine, the help's
placeholders, help on an unknown subcommand, flag case, and hints phrased in the magic's flags (tier 3).

All but one need no cluster; ``test_var_holding_something_else_says_what_it_holds`` uses the session cluster."""
from __future__ import annotations

import os

import pytest

import colab_kit as ck

RECORDED = [("config", ck.ParallelConfig(dp=2).to_dict()), ("cell", "x = 1\n", None)]


@pytest.fixture
def state(ip):
    s = ck.magics.state(ip)
    s.cluster, s.config, s.last, s.recorded = None, None, None, []
    yield s
    s.cluster, s.config, s.recorded = None, None, []


def _usage(run, src: str, *needles: str) -> str:
    error, out, err = run(src)
    assert type(error).__name__ == "UsageError", (src, error, out, err)
    text = out + err + str(error)
    for needle in needles:
        assert needle in text, (src, needle, text)
    assert "Traceback" not in text
    return text


# ---------------------------------------------------------------- 1, 2: export's PATH
def test_export_into_a_missing_folder_is_a_usage_error(run, state, tmp_path):
    state.recorded = list(RECORDED)
    target = tmp_path / "x" / "out" / "train.py"
    text = _usage(run, f"%colossal export {target}", f"the folder {target.parent} does not exist",
                  f"mkdir -p {target.parent}", f"the nearest that does is {tmp_path}")
    assert "FileNotFoundError" not in text and not (tmp_path / "x").exists()
    _usage(run, f"%colossal export {tmp_path / 'nope'}/", f"the folder {tmp_path / 'nope'} does not exist")
    (tmp_path / "afile").write_text("")
    _usage(run, f"%colossal export {tmp_path / 'afile' / 'train.py'}", f"{tmp_path / 'afile'} is a file, not a folder")


def test_export_into_an_unwritable_folder_is_a_usage_error(run, state, tmp_path, monkeypatch):
    """os.access says no (as it does for a user without write permission; root writes anywhere, so it is
    patched here); a write that fails anyway (an existing folder where the .sbatch goes) is one too."""
    from colab_kit.notebook.magics import export

    state.recorded = list(RECORDED)
    with monkeypatch.context() as m:
        m.setattr(export.os, "access", lambda path, mode: False)
        _usage(run, f"%colossal export {tmp_path / 'train.py'}", f"the folder {tmp_path} is not writable",
               "/tmp/train.py")
    assert not (tmp_path / "train.py").exists()
    (tmp_path / "train.sbatch").mkdir()
    _usage(run, f"%colossal export {tmp_path / 'train.py'}", f"cannot write {tmp_path / 'train.sbatch'}")


def test_export_path_rules_folder_suffix_and_none(run, state, tmp_path):
    from colab_kit.notebook.magics.export import script_path

    state.recorded = list(RECORDED)
    folder = tmp_path / "runs"
    folder.mkdir()
    error, out, _ = run(f"%colossal export {folder}")  # an existing folder: train.py inside it
    assert error is None, out
    assert "is a folder: the script is train.py in it" in out and f"wrote {folder / 'train.py'}" in out
    assert (folder / "train.py").exists() and (folder / "train.sbatch").exists()
    assert not (tmp_path / "runs.py").exists()
    text = _usage(run, f"%colossal export {tmp_path / 'train.txt'}", "the suffix '.txt'", "must be a .py file",
                  f"try {tmp_path / 'train'}.py")
    assert "train.txt.py" not in text and not list(tmp_path.glob("train.txt*"))
    error, out, _ = run(f"%colossal export {tmp_path / 'job'}")  # no suffix: .py added
    assert error is None and (tmp_path / "job.py").exists() and (tmp_path / "job.sbatch").exists(), out
    assert script_path(str(folder) + os.sep) == (str(folder / "train.py"), True)
    assert script_path(tmp_path / "a.py") == (str(tmp_path / "a.py"), False)
    assert script_path(tmp_path / "run.v2") == (str(tmp_path / "run.v2.py"), False)  # a dot in the name
    assert script_path(tmp_path / "A.PY") == (str(tmp_path / "A.PY"), False)


# ---------------------------------------------------------------- 3: unloading says what it stopped
class _FakeCluster:
    running, world_size, stopped = True, 4, 0

    def stop(self):
        self.stopped += 1
        self.running = False


def test_reload_ext_says_it_stopped_the_cluster_and_dropped_the_config(run, ip, state):
    fake = state.cluster = _FakeCluster()
    state.config = ck.ParallelConfig(dp=2, tp=2)
    error, out, _ = run("%reload_ext colab_kit")
    assert error is None, out
    assert fake.stopped == 1 and "stopped the cluster of 4 ranks" in out, out
    assert "dropped the kept config dp=2 x tp=2" in out and len(out.strip().splitlines()) == 1, out
    fresh = ck.magics.state(ip)
    assert fresh is not state and fresh.cluster is None and fresh.config is None
    error, out, _ = run("%reload_ext colab_kit")  # nothing to stop: nothing said
    assert error is None and out == ""


# ---------------------------------------------------------------- 4: --var naming something that is not an engine
def test_var_holding_something_else_says_what_it_holds(run, state, cluster):
    cluster._shared = True
    state.cluster = cluster
    error, out, _ = run("%colossal config dp=4")
    assert error is None, out
    error, out, _ = run("%%colossal\nimport torch, colab_kit as ck\nmi_data = (torch.zeros(2, 4), torch.zeros(2, 4))\n"
                        "mi_model = torch.nn.Linear(4, 4)\nmi_engine = ck.boost(torch.nn.Linear(4, 4), "
                        "lambda ps: torch.optim.SGD(ps, lr=0.1), config, mesh=mesh)")
    assert error is None, out
    try:
        for src, held in (("%colossal timeline --var mi_data", "tuple"), ("%colossal memory --var mi_data", "tuple"),
                          ("%colossal memory --var mi_model", "Linear"), ("%colossal profile --var mi_data", "tuple"),
                          ("%colossal moe --var mi_model", "Linear")):
            var = src.split()[-1]
            text = _usage(run, src, f"{var!r} on ranks [0, 1, 2, 3] holds a {held}, not an engine",
                          "the engines on every rank are in", "'mi_engine'", "--var NAME")
            assert f"{var} = ck.boost" not in text and "no engine in a variable" not in text, text
    finally:
        run("%%colossal\nmi_engine.close() if hasattr(mi_engine, 'close') else None\n"
            "del mi_data, mi_model, mi_engine")
        state.cluster = None


# ---------------------------------------------------------------- 5, 6: the help
def test_help_shows_no_placeholder_for_switches_and_positionals():
    from colab_kit.notebook.magics.flags import help_text

    lines = help_text().splitlines()
    flag = {line.split()[0]: line for line in lines if line.startswith("      -") or line.startswith("      PATH")}
    assert flag["--fit"].split()[1] == "start" and "FIT" not in help_text()
    assert flag["--timeline"].split()[1] == "one" and "TIMELINE" not in help_text()
    assert "PATH" in flag and "path PATH" not in help_text()
    assert flag["--engines"].split()[:2] == ["--engines", "ENGINES"]
    assert flag["-m,"].split()[:3] == ["-m,", "--microbatches", "M"]


def test_help_on_an_unknown_subcommand_says_so(run, state):
    from colab_kit.notebook.magics.flags import help_text

    text = _usage(run, "%colossal help nope", "%colossal help: 'nope' is not a subcommand", "Subcommands: start")
    assert help_text() not in text
    _usage(run, "%colossal help shedule", "'shedule' is not a subcommand (did you mean 'schedule'?)")
    error, out, _ = run("%colossal help schedule")
    assert error is None and out.startswith("usage: %colossal schedule")
    error, out, _ = run("%colossal help -h")
    assert error is None and out == help_text() + "\n"


# ---------------------------------------------------------------- 7: any case, as config reads it
def test_schedule_and_axis_flags_read_any_case(run, ip, state):
    error, out, _ = run("%colossal schedule --schedule 1F1B")
    assert error is None and out.startswith("1f1b, pp=4, microbatches=8"), (error, out)
    error, out, _ = run("%colossal schedule -m 4 --schedule ZB-H1")
    assert error is None and out.startswith("zb-h1, pp=4, microbatches=4"), (error, out)
    error, _, _ = run("fig = %colossal mesh --axis DP dp=2 tp=2")
    assert error is None and [list(t.customdata) for t in ip.user_ns["fig"].data] == [[0, 2], [1, 3]]
    _usage(run, "%colossal mesh --axis Expert dp=4 ep=2", "unknown axis 'expert'", "did you mean --axis experts?",
           "this mesh has axes pp, dp, sp, tp, edp, ep")


# ---------------------------------------------------------------- 8: hints in the magic's flags
def test_hints_are_phrased_in_the_magics_flags(run, state):
    text = _usage(run, "%colossal schedule --schedule interleaved --chunks 1", "needs chunks > 1", "try --chunks 2")
    assert "try chunks=2" not in text
    text = _usage(run, "%colossal schedule --schedule gpipe --chunks 3", "set --chunks 1 or --schedule interleaved")
    assert "schedule='interleaved'" not in text.split(": ")[-1]
    _usage(run, "%colossal schedule --pp 4 --schedule interleaved -m 6", "try --microbatches 4 or 8")
    _usage(run, "%colossal schedule --schedule zb-v --chunks 3", "set --chunks 2, or --schedule interleaved for 3")
    text = _usage(run, "%colossal mesh --axis experts dp=4", "does not split the experts (ep=1)",
                  "%colossal mesh --axis dp", "%colossal mesh --axis experts dp=4 ep=2")
    assert "mesh_figure(" not in text
    error, _, _ = run("%colossal mesh --axis experts dp=4 ep=2")
    assert error is None

"""The notebooks outside this machine: Google Colab and Binder.

- Every notebook opens with the same setup cell. Run in a real IPython shell where colab_kit is missing, it
  says how to name the package's source, or installs ``colab-kit[notebooks]`` from the one named (the ``%pip``
  magic is recorded here, not run); under Colab (``google.colab`` imported) it turns on Colab's custom widget
  manager; where colab_kit is installed and Colab is absent it does nothing.
- binder/'s environment built as repo2docker builds it (``binder/requirements.txt``, then ``binder/postBuild``)
  in a fresh virtual environment (``tests/binder_env.py``); the browser tier runs every notebook in it, or,
  where that tier cannot run, notebook 01 runs here with nbconvert, its EXPECT outputs checked.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _setup_cell(path: Path) -> dict:
    cells = json.loads(path.read_text())["cells"]
    return next(c for c in cells if c["cell_type"] == "code")


def test_every_notebook_opens_with_the_same_setup_cell():
    sources = {p.name: "".join(_setup_cell(p)["source"]) for p in NOTEBOOKS}
    first = sources[NOTEBOOKS[0].name]
    assert "COLAB_KIT_PIP" in first and "enable_custom_widget_manager" in first
    assert all(s == first for s in sources.values()), [n for n, s in sources.items() if s != first]


@pytest.fixture
def shell(ipython_shell, monkeypatch):
    """The IPython shell with ``%pip`` recorded instead of run."""
    ip = ipython_shell
    calls = []
    line_magics = ip.magics_manager.magics["line"]
    monkeypatch.setitem(line_magics, "pip", lambda line: calls.append(line))
    ip.pip_calls = calls
    return ip


def _run(shell, src: str):
    result = shell.run_cell(src)
    return result.error_in_exec or result.error_before_exec


def _without_colab_kit(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "colab_kit" else real(name, *a))


def test_the_setup_cell_installs_colab_kit_only_where_it_is_missing(shell, monkeypatch):
    src = "".join(_setup_cell(NOTEBOOKS[0])["source"])
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert _run(shell, src) is None and shell.pip_calls == []  # installed already, not on Colab: nothing

    _without_colab_kit(monkeypatch)
    monkeypatch.delenv("COLAB_KIT_PIP", raising=False)
    error = _run(shell, src)
    assert isinstance(error, RuntimeError) and "os.environ['COLAB_KIT_PIP']" in str(error)
    assert shell.pip_calls == []

    monkeypatch.setenv("COLAB_KIT_PIP", "git+https://example.invalid/colab_kit")
    assert _run(shell, src) is None
    assert shell.pip_calls == ['install -q "colab-kit[notebooks] @ git+https://example.invalid/colab_kit"']


def test_the_setup_cell_turns_on_colabs_widget_manager(shell, monkeypatch):
    src = "".join(_setup_cell(NOTEBOOKS[0])["source"])
    enabled = []
    google, colab = types.ModuleType("google"), types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: enabled.append(True))
    google.colab = colab
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    assert _run(shell, src) is None
    assert enabled == [True] and shell.pip_calls == []


# ---------------------------------------------------------------------- Binder
def _binder_requirements() -> list[str]:
    return [ln.split("#")[0].strip() for ln in (ROOT / "binder" / "requirements.txt").read_text().splitlines()
            if ln.split("#")[0].strip()]


def test_binder_lists_every_runtime_dependency_with_the_cpu_torch():
    """repo2docker ignores pyproject.toml when binder/ exists: its requirements must cover colab_kit's."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["notebooks"]
    have = {re.split(r"[<>=!~\[ ]", r)[0].lower() for r in _binder_requirements()}
    missing = [d for d in wanted if re.split(r"[<>=!~\[ ]", d)[0].lower() not in have]
    assert not missing, f"binder/requirements.txt lacks {missing}"
    assert "torch==2.13.0" in _binder_requirements()  # the CPU build (an unpinned torch is a CUDA one)


def test_binder_environment_builds_fresh_and_runs_notebook_01(binder_env, tmp_path):
    """repo2docker's steps in a new venv (tests/binder_env.py, built once per session): colab_kit and the CPU
    torch come from that venv. The browser tier serves every notebook from this environment's JupyterLab and
    checks that each kernel ran its python; where that tier cannot run, notebook 01 runs here instead, with
    this environment's own nbconvert (it comes with jupyterlab), its EXPECT outputs checked."""
    from tests.helpers.notebooks import BINDER_RUNS, browser_runs as _browser_runs, expected_problems

    env = binder_env.env()
    where = subprocess.run([binder_env.python, "-c", "import colab_kit, torch, ipyparallel, sklearn, transformers; "
                            "print(colab_kit.__file__, torch.__version__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.startswith(str(binder_env.venv)) and "+cpu" in where.stdout, where.stdout
    if _browser_runs():
        return  # tests/notebooks/test_browser.py runs notebook 01 (and the rest) in this environment, in JupyterLab
    out = tmp_path / f"executed-{BINDER_RUNS}"
    run = subprocess.run([str(binder_env.bin / "jupyter"), "nbconvert", "--to", "notebook", "--execute",
                          "--ExecutePreprocessor.timeout=600", "--output", str(out),
                          str(ROOT / "notebooks" / BINDER_RUNS)],
                         cwd=ROOT / "notebooks", env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    problems = expected_problems(BINDER_RUNS, json.loads(out.read_text())["cells"])
    assert not problems, "\n".join(problems)

"""binder/'s environment, built as repo2docker builds it, in a fresh virtual environment (once per session).

repo2docker, given a ``binder/`` folder, installs ``binder/requirements.txt`` with pip and then runs
``binder/postBuild`` from the repository root; it ignores ``pyproject.toml``. ``build(where)`` does the same
in a new venv at ``where`` and returns a ``BinderEnv``. The browser tier (tests/notebooks/test_browser.py) serves the
notebooks from that environment's own JupyterLab, so every notebook, 01 first, runs in what Binder builds;
tests/notebooks/test_colab_binder.py checks the environment itself (and runs notebook 01 in it with nbconvert where
the browser tier cannot run).

``pip --no-compile`` and then one import of what the notebooks use: pip's byte-compiling of every installed
file took 58 s against 26 s without it, and the import writes the bytecode the kernel and the engines read
(about 6 s). ``PYTHONDONTWRITEBYTECODE`` is dropped in this environment, as Binder does not set it: with it,
every engine would compile torch from source at each start. Nothing else differs from Binder's build.

``env()`` also sets ``MEM_LIMIT`` to mybinder.org's 2 GiB, as JupyterHub's KubeSpawner does in every Binder
session: the notebooks that ask for 8 engines with ``--fit`` start the 4 that memory holds there
(``colab_kit.notebook.cluster.room``), so the browser tier runs what a Binder user runs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BINDER_MEM_LIMIT = 2 * 2**30  # bytes: mybinder.org's memory limit per session
WARM = ("import torch, torch.distributed, ipyparallel, ipyparallel.engine, ipykernel.kernelapp, ipywidgets, anywidget, "
        "plotly.graph_objects, sklearn.datasets, transformers, colab_kit, colab_kit.notebook.magics, colab_kit.viz")


@dataclass
class BinderEnv:
    venv: Path
    log: str = ""

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    @property
    def python(self) -> str:
        return str(self.bin / "python")

    def env(self, base: dict | None = None) -> dict:
        """Environment variables under which this venv's ``python``/``jupyter`` come first, as in Binder."""
        env = dict(os.environ if base is None else base)
        env.update(PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(self.venv),
                   PIP_DISABLE_PIP_VERSION_CHECK="1", MEM_LIMIT=str(BINDER_MEM_LIMIT))
        # none of these is set on Binder; COLAB_KIT_PRELOAD is this suite's own (tests/conftest.py)
        for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "COLAB_KIT_PRELOAD"):
            env.pop(name, None)
        return env


def build(where: Path, nice: int = 0) -> BinderEnv:
    """Make the venv, pip install -r binder/requirements.txt, run binder/postBuild; raise with the log's tail
    on any failure. ``nice``: added to each step's niceness (a build in the background yields to the tests)."""
    out = BinderEnv(Path(where))
    steps = [([sys.executable, "-m", "venv", str(out.venv)], 120),
             ([str(out.bin / "pip"), "install", "-q", "--no-compile", "-r", "binder/requirements.txt"], 900),
             (["bash", "binder/postBuild"], 300),
             ([str(out.bin / "python"), "-c", WARM], 300)]
    for cmd, timeout in steps:
        niced = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []  # no preexec_fn: threads
        run = subprocess.run(niced + cmd, cwd=ROOT, env=out.env(), capture_output=True, text=True, timeout=timeout)
        out.log += f"$ {' '.join(cmd)}\n{run.stdout[-2000:]}{run.stderr[-3000:]}\n"
        if run.returncode != 0:
            raise RuntimeError(f"building binder/'s environment failed at {' '.join(cmd[:3])}:\n{out.log[-4000:]}")
    return out


if __name__ == "__main__":  # python -m tests.binder_env WHERE: build WHERE/venv, then write WHERE/result.json
    import json

    folder = Path(sys.argv[1])
    try:
        built, ok = build(folder / "venv"), True
        log = built.log
    except Exception as exc:  # noqa: BLE001 - the reader raises it with the log
        ok, log = False, str(exc)
    (folder / "result.tmp").write_text(json.dumps({"ok": ok, "log": log}))
    (folder / "result.tmp").rename(folder / "result.json")

"""Shared fixtures: one 4-engine cluster for the whole session (the notebook tier), the small GPT's
one-process references (``gpt_references``), and binder/'s environment, built in the background from the
start of the session (``binder_env``); one torch thread in this process and its kernels, NCCL's rules and
the fork server's preloads for every launch (``pytest_configure``); under the suite's two pytest-xdist
workers, a temporary folder of each worker's own, and binder/'s build and the type check started once for both
(docs/testing.md, "Two streams").

Starting engines costs ~7 s each time on a 2-core machine, so every test that
only needs a working cluster shares this one (one per worker that runs such tests); tests that must start, stop or
restart a cluster of their own do it explicitly (and keep it small).
"""
from __future__ import annotations

import pytest


def pytest_configure(config):
    """One torch thread in the pytest process and, through ``OMP_NUM_THREADS`` (unless set already), in the
    processes it starts that do not choose their own (the notebooks' kernels): their own work (one-process
    references, small models trained in place) is far too small to gain from a second thread, and on a
    loaded 2-core machine two OpenMP threads that wait for each other at every op ran 25 times slower than
    one (a ViT step: 257 ms against 10 ms; test_vit_learns_the_digits 115 s against 3 s; notebook 07 under
    nbclient 96 s against 78 s). The ranks and engines set their own threads (``colab_kit.launch.place_rank``),
    so what they run is unchanged."""
    import os
    import signal

    import torch

    # A run started as a background job of a non-interactive shell (`pytest ... &`, a CI script's `&`) inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the tests of a Ctrl-C
    # (``_thread.interrupt_main``) would wait out their cells' sleeps. Python's own handler, as in a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # every multi-rank test plays NCCL's rules: ck.launch's default already, and ck.init's (torchrun, Slurm, MPI
    # scripts the tests start) through this (docs/nccl.md)
    os.environ.setdefault("COLAB_KIT_CPU_BACKEND", "nccl_rules")
    # every test module imports pytest and most tests.helpers; a rank imports its function's module to unpickle
    # it: ck.launch's fork server imports both once instead (colab_kit.launch.preloaded)
    os.environ.setdefault("COLAB_KIT_PRELOAD", "pytest,tests.helpers")
    torch.set_num_threads(1)
    _worker_tmpdir(config)


SHARED_ENV = "COLAB_KIT_TEST_SHARED"
"""Under pytest-xdist (the suite's default: ``-n 2`` in pyproject.toml), the folder the controller made for this
run: what the workers share (binder/'s environment and the type check, each started once by whichever worker
claims it first) and each worker's own temporary folder."""


def _worker_tmpdir(config) -> None:
    """Two workers run the suite's files side by side (``--dist loadfile``): one runs a tier's ranks while the
    other waits on a browser, a kernel or a cluster. The controller makes one folder for the run
    (``pytest_sessionstart``, removed at its end by ``pytest_sessionfinish``); each worker takes its own temporary
    folder in it here (``TMPDIR``, read by every process it starts), so what one worker's tests leave in a
    temporary folder (a notebook's checkpoint, a rank's stacks) is never taken for another's."""
    import os
    import tempfile

    if getattr(config, "workerinput", None) is not None:  # a worker: its own TMPDIR inside the run's folder
        shared = os.environ.get(SHARED_ENV)
        if shared:
            own = os.path.join(shared, f"tmp-{config.workerinput['workerid']}")
            os.makedirs(own, exist_ok=True)
            os.environ["TMPDIR"] = tempfile.tempdir = own


def pytest_sessionstart(session):
    """The controller's folder for the run, made before pytest-xdist starts its workers (its own
    ``pytest_sessionstart`` runs last), which inherit its name; nothing in one stream."""
    import os
    import tempfile

    config = session.config
    if getattr(config, "workerinput", None) is not None:
        return
    # a run that is not a worker never takes an outer run's folder (a pytest started inside a test's environment)
    os.environ.pop(SHARED_ENV, None)
    if getattr(config.option, "numprocesses", None) and not getattr(config.option, "collectonly", False):
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="colab-kit-run-")


def _claim(name: str) -> tuple:
    """``(folder, ours)`` for a shared background job ``name``: under xdist the run's folder for it and whether
    this worker is the first to claim it (it starts the job; the others wait for its result); without xdist a
    new folder, always ours."""
    import os
    import tempfile
    from pathlib import Path

    shared = os.environ.get(SHARED_ENV)
    if not shared:
        return Path(tempfile.mkdtemp(prefix=f"colab-kit-{name}-")), True
    where = Path(shared) / name
    try:
        os.close(os.open(Path(shared) / f"{name}.claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return where, False
    where.mkdir()
    return where, True


@pytest.fixture(scope="session")
def session_cluster():
    from colab_kit.notebook.cluster import Cluster

    cluster = Cluster(n=4, timeout=180).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(session_cluster):
    """The session cluster, healthy and with no config: restarted first if an earlier test broke it."""
    c = session_cluster
    if c.needs_restart or c._busy:
        c.restart()
    if c.config is not None:
        c.set_config(None)
    return c


@pytest.fixture(scope="session")
def ipython_shell():
    """The session's one IPython shell. IPython's test shell is a singleton and ``start_ipython`` returns it
    only to its first caller: every test module that drives magics asks for it here."""
    from IPython.testing import globalipapp

    return globalipapp.start_ipython() or globalipapp.get_ipython()


_BINDER: dict = {}
"""The build of binder/'s environment under way: {"dir": its folder (venv/, then result.json)}."""


def _start_binder_build() -> None:
    """``python -m tests.binder_env DIR``, niced, detached (started through a parent that exits at once): a
    notebook-layer cluster takes this process's new descendants for its controller's, so a pip run under
    this process while a cluster starts would be watched, and its end taken for the controller's death."""
    import subprocess
    import sys

    from tests.binder_env import ROOT

    where, ours = _claim("binder")
    _BINDER["dir"] = where
    if not ours:  # another worker builds it: this one waits for its result.json
        return
    cmd = ["nice", "-n", "10", sys.executable, "-m", "tests.binder_env", str(where)]
    detach = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True, stdout=subprocess.DEVNULL)"
    subprocess.run([sys.executable, "-c", detach, *cmd], cwd=ROOT, check=True)


def _binder_result(timeout: float = 1800) -> dict:
    import json
    import time

    result, deadline = _BINDER["dir"] / "result.json", time.monotonic() + timeout
    while not result.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"binder/'s environment was not built within {timeout:.0f} s in {_BINDER['dir']}")
        time.sleep(0.5)
    return json.loads(result.read_text())


def _runs(item) -> bool:
    """Whether ``item`` will run: not under a ``skipif`` whose condition is already True (the browser tier
    without Chromium)."""
    return not any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))


def pytest_collection_finish(session):
    """Where a test that will run needs binder/'s environment, start building it now, in the background and
    niced (pip unpacks 1.4 GB, about 70 s on 2 cores): the cluster tier runs meanwhile, and the notebook tier
    finds it built instead of waiting for it (the browser tier's set-up took 105 s, nearly all this build).
    Likewise the type check (``mypy colab_kit``, 35 s cold on 2 cores) where ``test_mypy_is_clean`` will run:
    at the lowest priority, on the CPU time the other tiers leave idle; the test reads its result. Neither
    under ``--collect-only``, which runs no test."""
    if session.config.option.collectonly:
        return
    if any("binder_env" in getattr(item, "fixturenames", ()) and _runs(item) for item in session.items):
        _start_binder_build()
    if any(item.nodeid.endswith("test_lint.py::test_mypy_is_clean") for item in session.items):
        _start_mypy()


_MYPY: dict = {}
"""The type check under way: {"dir": where it writes out.txt, then rc.txt}."""


def _start_mypy() -> None:
    """``python -m mypy colab_kit`` from the repository root at nice 19, detached as the binder build is (so a
    cluster starting meanwhile never takes it for one of its own processes); nothing without mypy installed."""
    import importlib.util
    import os
    import subprocess
    import sys

    from tests.binder_env import ROOT

    if importlib.util.find_spec("mypy") is None:
        return
    where, ours = _claim("mypy")
    _MYPY["dir"] = where
    if not ours:
        return
    run = (f"nice -n 19 {sys.executable} -m mypy colab_kit > {where / 'out.txt'} 2>&1; "
           f"echo $? > {where / 'rc.tmp'} && mv {where / 'rc.tmp'} {where / 'rc.txt'}")
    detach = ("import subprocess, sys; subprocess.Popen(['sh', '-c', sys.argv[1]], start_new_session=True, "
              "stdout=subprocess.DEVNULL)")
    subprocess.run([sys.executable, "-c", detach, run], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def mypy_result(timeout: float = 600) -> tuple[int, str] | None:
    """``(return code, output)`` of the type check started at collection, waited for; None if none was started
    (the test then runs it itself)."""
    import time

    if not _MYPY:
        return None
    where, deadline = _MYPY["dir"], time.monotonic() + timeout
    while not (where / "rc.txt").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"mypy did not finish within {timeout:.0f} s in {where}")
        time.sleep(0.2)
    return int((where / "rc.txt").read_text()), (where / "out.txt").read_text()


def pytest_sessionfinish(session):
    """The build waited for (a session cut short may end while it runs) and its folder removed: 1.4 GB each; the
    type check's folder removed. Under xdist a worker leaves both to the controller, which waits for a build
    the workers claimed and removes the run's folder once every worker has ended."""
    import os
    import shutil
    from pathlib import Path

    if getattr(session.config, "workerinput", None) is not None and os.environ.get(SHARED_ENV):
        return
    if _MYPY:
        shutil.rmtree(_MYPY.pop("dir"), ignore_errors=True)
    if _BINDER:
        try:
            _binder_result()
        finally:
            shutil.rmtree(_BINDER.pop("dir"), ignore_errors=True)
    shared = os.environ.get(SHARED_ENV)
    if shared and getattr(session.config, "workerinput", None) is None:
        try:  # a Ctrl-C during this wait still removes the folder (binder/'s 1.4 GB and the workers' TMPDIRs)
            if (Path(shared) / "binder.claimed").exists():
                _BINDER["dir"] = Path(shared) / "binder"
                try:
                    _binder_result()
                except RuntimeError:
                    pass
        finally:
            shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(scope="session")
def binder_env():
    """binder/'s environment built in a fresh venv, once per session (tests/binder_env.py), started when the
    session's tests were collected (``pytest_collection_finish``): the browser tier's JupyterLab runs from it,
    and tests/notebooks/test_colab_binder.py checks it."""
    from tests.binder_env import BinderEnv

    if not _BINDER:
        _start_binder_build()
    result = _binder_result()
    if not result["ok"]:
        raise RuntimeError(result["log"])
    return BinderEnv(_BINDER["dir"] / "venv", result["log"])


@pytest.fixture(scope="session")
def gpt_references():
    """{optimizer: (losses, {name: trained parameter})} of tests/helpers' small GPT trained in one process."""
    from tests.helpers import OPTIMIZERS, gpt_reference

    return {opt: gpt_reference(opt) for opt in OPTIMIZERS}

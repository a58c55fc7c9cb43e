"""Shared fixtures: one 4-engine cluster for the whole session (the notebook tier), and the small GPT's
one-process references (``gpt_references``).

Starting engines costs ~7 s each time on a 2-core machine, so every test that
only needs a working cluster shares this one; tests that must start, stop or
restart a cluster of their own do it explicitly (and keep it small).
"""
from __future__ import annotations

import pytest


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


@pytest.fixture(scope="session")
def binder_env(tmp_path_factory):
    """binder/'s environment built in a fresh venv, once per session (tests/binder_env.py): the browser
    tier's JupyterLab runs from it, and tests/notebooks/test_colab_binder.py checks it."""
    from tests.binder_env import build

    return build(tmp_path_factory.mktemp("binder") / "venv")


@pytest.fixture(scope="session")
def gpt_references():
    """{optimizer: (losses, {name: trained parameter})} of tests/helpers' small GPT trained in one process."""
    from tests.helpers import OPTIMIZERS, gpt_reference

    return {opt: gpt_reference(opt) for opt in OPTIMIZERS}

"""Shared fixtures of the notebook tier: one 4-engine cluster for the whole session.

Starting engines costs ~7 s each time on a 2-core machine, so every test that
only needs a working cluster shares this one; tests that must start, stop or
restart a cluster of their own do it explicitly (and keep it small).
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def session_cluster():
    from colab_kit.cluster import Cluster

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

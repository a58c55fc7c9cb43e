"""``ck.launch`` and ``ck.Cluster`` refuse what every rank would fail at before any process starts, each with the
rule and a value that works (before: a bad file descriptor and a C++ stack dump for timeout=0, an assertion
in every rank for an unknown backend, engines started then failing for Cluster(timeout=0))."""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck


def _never(*_):
    raise AssertionError("no rank may start")


@pytest.mark.parametrize("kwargs, world, error, words", [
    (dict(backend="glooo"), 2, ValueError, "backend='glooo' is not one launch runs: 'nccl_rules'"),
    (dict(timeout=0), 2, ValueError, "timeout must be a number of seconds > 0, got 0"),
    (dict(timeout=-1), 2, ValueError, "timeout must be a number of seconds > 0, got -1"),
    (dict(grace="5"), 2, ValueError, "grace must be a number of seconds >= 0, got '5'"),
    (dict(threads=-2), 2, ValueError, "threads must be a whole number of torch threads per rank"),
    (dict(threads=1.5), 2, ValueError, "threads must be a whole number"),
    (dict(), True, ValueError, "world_size must be a positive whole number, got True"),
])
def test_launch_refuses_before_any_rank_starts(kwargs, world, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        ck.launch(_never, world, **kwargs)


def test_launch_refuses_what_cannot_run():
    with pytest.raises(TypeError, match="fn must be callable, got NoneType"):
        ck.launch(None, 2)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match=r"backend='nccl' gives each rank its own GPU: 2 ranks"):
            ck.launch(_never, 2, backend="nccl")


@pytest.mark.parametrize("kwargs, rule", [(dict(timeout=0), "> 0"), (dict(grace=-1), ">= 0"),
                                          (dict(collective_timeout="x"), "> 0")])
def test_a_cluster_refuses_timeouts_that_are_not_positive(kwargs, rule):
    name, value = next(iter(kwargs.items()))
    from colab_kit.notebook.cluster.gather import ClusterError

    with pytest.raises(ClusterError) as info:
        ck.Cluster(2, **kwargs)
    assert f"{name} must be a number of seconds {rule}, got {value!r}" in str(info.value)

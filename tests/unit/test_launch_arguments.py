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


def test_boost_refuses_what_is_no_model_loss_or_policy():
    """Before: the message named an internal (``ModelFacts.of``), a loss of 3 failed at the first step with
    "'int' object is not callable", a policy named by a string raised a TypeError that named no alternative."""
    from colab_kit.models import GPT, GPTConfig

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    with pytest.raises(TypeError, match=r"boost shards a torch.nn.Module, got NoneType"):
        ck.boost(None, sgd, ck.ParallelConfig())
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises(ck.ConfigError, match=r"loss_fn must be a function \(logits, targets\) -> scalar loss, got int"):
        ck.boost(model, sgd, ck.ParallelConfig(), loss_fn=3)
    with pytest.raises(TypeError, match=r"policy must be a colab_kit.policy.Policy, got str: leave it out"):
        ck.boost(model, sgd, ck.ParallelConfig(), policy="gpt")


def test_a_checkpoint_and_a_pretrained_directory_are_told_apart(tmp_path):
    from colab_kit.checkpoint import CheckpointError
    from colab_kit.checkpoint.files import read_manifest
    from colab_kit.checkpoint.pretrained import _files

    weights = tmp_path / "model.pt"
    weights.write_text("x")
    with pytest.raises(CheckpointError, match=r"it is a file, and a colab_kit checkpoint is the directory"):
        read_manifest(str(weights))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "manifest.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"is a colab_kit checkpoint \(engine.save's\), not a save_pretrained"):
        _files(str(tmp_path / "ck"))
    with pytest.raises(ck.ConfigError, match=r"unknown hardware '8xH100': did you mean '8xH100-SXM'\?"):
        ck.estimate(GPTConfig_small(), ck.ParallelConfig(dp=8), 8, hardware="8xH100")


def GPTConfig_small():
    from colab_kit.models import GPTConfig

    return GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)

"""Staging (several ranks on one GPU, ``comm/rules/staging.py``) copies to the host only what a call reads: a
gather's or a receive's outputs get empty host buffers (``written``), an all-reduce's tensor is copied, and an
output that is an input too is copied either way."""
from __future__ import annotations

import torch

from colab_kit.comm.rules import staging


def _copied(monkeypatch) -> list:
    seen: list = []
    real = staging._host

    def host(t):
        seen.append(t)
        return real(t)

    monkeypatch.setattr(staging, "_host", host)
    return seen


def test_a_written_output_is_not_copied_to_the_host(monkeypatch):
    seen = _copied(monkeypatch)
    out, inp = torch.full((4,), 7.0), torch.ones(2)
    host_args, back = staging.to_host([out, inp], [out], written=True)
    assert [t is inp for t in seen] == [True]  # the input only
    assert back[0][0] is out and back[0][1] is host_args[0] and host_args[1].tolist() == [1.0, 1.0]


def test_an_in_place_call_and_an_output_read_as_input_are_copied(monkeypatch):
    seen = _copied(monkeypatch)
    x = torch.full((2,), 3.0)
    host_args, back = staging.to_host([x], [x])  # an all-reduce reads what it writes
    assert seen == [x] and host_args[0].tolist() == [3.0, 3.0]
    seen.clear()
    staging.to_host([[x], [x]], [x], written=True)  # the same tensor given as input too
    assert seen == [x]

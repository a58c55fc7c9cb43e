"""The docstrings' examples run: every module of the package is collected here, so an example
that stops matching the code fails the suite. Examples that need ranks (a mesh, a running
job) are marked ``# doctest: +SKIP`` in place and stay as documentation; the ones that can
run in one process (shapes, plans, configs, layouts, formulas) do."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import colab_kit

MODULES = sorted(m.name for m in pkgutil.walk_packages(colab_kit.__path__, "colab_kit.")
                 if not m.name.startswith("colab_kit.__main__"))


def test_the_tensor_modules_are_collected():
    tensor = [m for m in MODULES if m.startswith("colab_kit.tensor.")]
    assert {"colab_kit.tensor.tp1d", "colab_kit.tensor.tp2d", "colab_kit.tensor.tp3d"} <= set(tensor), tensor


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, extraglobs={"ck": colab_kit, "torch": torch},
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (run with -s to see)"

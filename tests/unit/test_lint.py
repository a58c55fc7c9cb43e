"""The linter and the type checker are clean on the package, with the settings in pyproject.toml.

``ruff check`` (the rules in ``[tool.ruff]``: the package in full, tests and bench for pyflakes'
findings) and ``mypy colab_kit`` (``[tool.mypy]``) run as a contributor runs them, from the
repository root; any finding fails the test with the tool's own report.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, not an installed one
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _check(tool: str, *args: str, timeout: float) -> None:
    pytest.importorskip(tool)
    done = _run(tool, *args, timeout=timeout)
    assert done.returncode == 0, f"{tool} {' '.join(args)} found problems:\n{done.stdout}{done.stderr}"


def test_ruff_is_clean():
    _check("ruff", "check", "--no-cache", "--output-format", "concise", "colab_kit", "tests", "bench", timeout=120)


def test_mypy_is_clean():
    """One cold run is about 35 s on 2 cores: a whole-suite session starts it at collection, niced, on the CPU
    the other tiers leave idle (``tests/conftest.py``), and this reads its result; alone, it runs here."""
    from tests.conftest import mypy_result

    pytest.importorskip("mypy")
    started = mypy_result()
    if started is None:
        _check("mypy", "colab_kit", timeout=600)
        return
    rc, out = started
    assert rc == 0, f"mypy colab_kit found problems:\n{out}"

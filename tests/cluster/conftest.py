"""The cluster tier's IPython fixtures: ``ip`` (the session's shell with the ``%colossal`` magics loaded and plotly
rendering to JSON, no browser) and ``run`` (one cell: its error, stdout and stderr)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ip(ipython_shell):
    import plotly.io as pio

    old, pio.renderers.default = pio.renderers.default, "json"  # no browser to open here
    ipython_shell.run_line_magic("load_ext", "colab_kit")
    yield ipython_shell
    pio.renderers.default = old


@pytest.fixture
def run(ip, capsys):
    """run(src) -> (error or None, stdout, stderr) of one cell."""
    def _run(src: str):
        capsys.readouterr()
        result = ip.run_cell(src)
        out, err = capsys.readouterr()
        return result.error_in_exec or result.error_before_exec, out, err
    return _run

"""Every notebook in notebooks/ runs top to bottom in a real kernel (tier 3).

Parametrized over the folder, so a new notebook is tested as soon as it is added.
Cells tagged ``raises-exception`` may fail (nbclient's convention); any other
error fails the test with the cell and its traceback. ``EXPECT`` adds, per
notebook, outputs that must appear under the cell whose source contains a marker.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.notebooks import (ASKED, BINDER_RUNS, EIGHT_ELSEWHERE, NOTEBOOKS, browser_runs, expected_problems,
                                     left_in_temp, started_ranks, temp_entries)

@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path):
    """nbclient runs the notebook where the browser tier cannot; where it can, tests/notebooks/test_browser.py
    runs it top to bottom in JupyterLab and checks these same outputs on what the kernel sent
    (one run of each notebook per suite, not two), under Binder's memory: the notebooks in ``ASKED``
    start fewer engines there, so this runs them here as well, with this machine's memory."""
    if browser_runs() and path.name not in ASKED:
        pytest.skip("run top to bottom in JupyterLab by tests/notebooks/test_browser.py, which checks the same EXPECT outputs")
    if browser_runs() and path.name in EIGHT_ELSEWHERE:
        pytest.skip(f"run on 4 ranks by tests/notebooks/test_browser.py; {EIGHT_ELSEWHERE[path.name]}")
    if path.name == BINDER_RUNS:
        pytest.skip("run top to bottom in binder/'s environment by tests/notebooks/test_colab_binder.py, which checks "
                    "the same EXPECT outputs (once per suite, as where the browser tier runs it)")
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{path.name} is committed with outputs: clear them"
    client = NotebookClient(nb, kernel_name="python3", timeout=600, startup_timeout=120,
                            resources={"metadata": {"path": str(path.parent)}})
    before = temp_entries()
    client.execute()  # raises CellExecutionError naming the cell that failed
    problems = expected_problems(path.name, nb.cells, started_ranks(nb.cells)) + left_in_temp(path.name, before)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_are_committed_without_outputs(path: Path):
    """No outputs, and every cell with its id (nbformat 4.5 requires one: JupyterLab adds a missing one on save
    and nbformat warns that it will become an error)."""
    import json

    import nbformat

    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{path.name} is committed with outputs: clear them"
    raw = json.loads(path.read_text())
    missing = [i for i, cell in enumerate(raw["cells"]) if "id" not in cell]
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5) and not missing, \
        f"{path.name}: cells {missing} have no id (nbformat 4.5): nbformat.validator.normalize() adds them"

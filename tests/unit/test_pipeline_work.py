"""The pipeline executor is handed a step's work (``colab_kit.pipeline.work.MicrobatchWork``) and returns.

Read from the source (no process started): the executor and its compute actions never name an engine, and every
attribute they read off the step's work (``self.work.X``, or ``X`` of a local bound to ``self.work``) is a field
of ``MicrobatchWork`` (``tests/ranks/test_pipeline_engine.py`` runs them).
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import colab_kit
from colab_kit.pipeline.work import MicrobatchWork

PIPELINE = Path(colab_kit.__file__).parent / "pipeline"
FIELDS = {f.name for f in dataclasses.fields(MicrobatchWork)}


def _reads_of(path: Path, owner_attr: str) -> set[str]:
    """Names read off ``self.<owner_attr>`` in ``path``, directly or through a local bound to it."""
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):  # w = self.work
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == owner_attr:
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Attribute) and owner.attr == owner_attr and isinstance(owner.value, ast.Name) \
                and owner.value.id == "self":
            used.add(node.attr)
        elif isinstance(owner, ast.Name) and owner.id in aliases:
            used.add(node.attr)
    return used


def test_the_executor_reads_only_the_declared_work_and_names_no_engine():
    files = [PIPELINE / "executor.py", PIPELINE / "compute.py", PIPELINE / "messages.py"]
    used = set().union(*(_reads_of(f, "work") for f in files))
    assert used, "found no read of the step's work at all: the reader is broken"
    assert used <= FIELDS, f"the executor reads {sorted(used - FIELDS)} of the work outside MicrobatchWork"
    engine = set().union(*(_reads_of(f, "engine") for f in files))
    assert not engine, f"the executor reaches into an engine: {sorted(engine)}"


def test_the_reader_sees_an_undeclared_read(tmp_path):
    """The check above can fail: a source that reads ``self.work._update`` or ``self.engine.mesh`` is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("class X:\n    def f(self):\n        w = self.work\n        w._update(1)\n"
                   "        return self.engine.mesh\n")
    assert _reads_of(bad, "work") == {"_update"}
    assert _reads_of(bad, "engine") == {"mesh"}


def _assigned_on_self(path: Path) -> set[str]:
    """``X`` of every ``self.X = ...`` / ``self.X: T = ...`` / ``self.X, self.Y = ...`` in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    return names


def test_every_gradient_part_provides_the_declared_interface_and_nothing_probes_for_it():
    """``engine.data_parallel`` is plain dp's ``DataParallel`` or ZeRO stage 1, 2 or 3's part; each provides every
    name of ``colab_kit.zero.stage0.GradientPart`` (so the engine calls them plainly), and no module probes it with
    ``getattr`` / ``hasattr`` any more."""
    import re

    from colab_kit.zero import DataParallel, GradientPart, ZeroStage1, ZeroStage2, ZeroStage3

    names = set(GradientPart.__annotations__) | {n for n in vars(GradientPart) if not n.startswith("_")}
    assert {"arm", "finish", "masters", "host_bytes", "gathered", "placement"} <= names
    zero3 = _assigned_on_self(PIPELINE.parent / "zero" / "stage3.py")
    for part in (DataParallel, ZeroStage1, ZeroStage2, ZeroStage3):
        instance = _assigned_on_self(Path(__import__(part.__module__, fromlist=["x"]).__file__)) | (
            _assigned_on_self(PIPELINE.parent / "zero" / "stage0.py") if part is not ZeroStage3 else zero3)
        missing = [n for n in names if not hasattr(part, n) and n not in instance]
        assert not missing, f"{part.__name__} lacks {missing} of GradientPart"
    probes = [f"{path.relative_to(PIPELINE.parent)}:{i}"
              for path in PIPELINE.parent.rglob("*.py") for i, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"(getattr|hasattr)\(\s*(self|engine|eng|step|parts)\.(grads|data_parallel)\b", line)]
    assert not probes, f"probes of engine.data_parallel: {probes}"

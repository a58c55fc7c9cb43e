"""The pipeline executor reaches its engine only through ``colab_kit.pipeline.host.PipelineHost``.

Read from the source (no process started): every attribute the executor and its compute actions take from
the engine (``engine.X``, ``self.engine.X``, ``eng.X``) is a name of the protocol, none is private, and the
engine provides every name of the protocol (``tests/ranks/test_pipeline_engine.py`` runs them).
"""
from __future__ import annotations

import ast
from pathlib import Path

import colab_kit.engine.core
from colab_kit.engine.core import Engine
from colab_kit.pipeline.host import HOST_NAMES

PIPELINE = Path(colab_kit.__file__).parent / "pipeline"


def _engine_attributes(path: Path) -> set[str]:
    """Names read off the engine in ``path``: ``self.engine.X``, or ``X`` of a local bound to ``self.engine``."""
    tree = ast.parse(path.read_text())
    aliases = {"engine"}
    for node in ast.walk(tree):  # eng = self.engine
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "engine":
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Attribute) and owner.attr == "engine" and isinstance(owner.value, ast.Name) \
                and owner.value.id == "self":
            used.add(node.attr)
        elif isinstance(owner, ast.Name) and owner.id in aliases and owner.id != "self":
            used.add(node.attr)
    return used


def test_the_executor_uses_only_the_declared_interface():
    used = _engine_attributes(PIPELINE / "executor.py") | _engine_attributes(PIPELINE / "compute.py")
    assert used, "found no engine access at all: the reader is broken"
    assert used <= HOST_NAMES, f"the executor reaches {sorted(used - HOST_NAMES)} of the engine outside PipelineHost"
    assert not [n for n in used if n.startswith("_")]


def test_the_reader_sees_a_private_reach(tmp_path):
    """The check above can fail: a source that reaches ``engine._update`` is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("class X:\n    def f(self):\n        eng = self.engine\n        eng._update(1)\n"
                   "        return self.engine.mesh\n")
    assert _engine_attributes(bad) == {"_update", "mesh"}


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


def test_the_engine_provides_every_name_of_the_protocol():
    instance = _assigned_on_self(Path(colab_kit.engine.core.__file__))
    missing = [name for name in HOST_NAMES if not hasattr(Engine, name) and name not in instance]
    assert not missing, f"Engine lacks {missing} of PipelineHost"
    assert {"finish_step", "pipeline_loss", "events", "activation_meter", "loss_shards"} <= HOST_NAMES


def test_every_gradient_part_provides_the_declared_interface_and_nothing_probes_for_it():
    """``engine.grads`` is plain dp's ``ZeroStage0`` or ZeRO stage 1, 2 or 3's part; each provides every name of
    ``colab_kit.zero.stage0.GradientPart`` (so the engine calls them plainly), and no module probes ``grads`` with
    ``getattr`` / ``hasattr`` any more."""
    import re

    from colab_kit.zero import GradientPart, ZeroStage0, ZeroStage1, ZeroStage2, ZeroStage3

    names = set(GradientPart.__annotations__) | {n for n in vars(GradientPart) if not n.startswith("_")}
    assert {"arm", "finish", "masters", "host_bytes", "gathered", "placement"} <= names
    zero3 = _assigned_on_self(PIPELINE.parent / "zero" / "stage3.py")
    for part in (ZeroStage0, ZeroStage1, ZeroStage2, ZeroStage3):
        instance = _assigned_on_self(Path(__import__(part.__module__, fromlist=["x"]).__file__)) | (
            _assigned_on_self(PIPELINE.parent / "zero" / "stage0.py") if part is not ZeroStage3 else zero3)
        missing = [n for n in names if not hasattr(part, n) and n not in instance]
        assert not missing, f"{part.__name__} lacks {missing} of GradientPart"
    probes = [f"{path.relative_to(PIPELINE.parent)}:{i}"
              for path in PIPELINE.parent.rglob("*.py") for i, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"(getattr|hasattr)\(\s*(self|engine|eng)\.grads\b", line)]
    assert not probes, f"probes of engine.grads: {probes}"

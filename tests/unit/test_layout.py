"""The package's layout holds: packages import one way, down the layers of ``LAYERS`` (function-local imports
included, no exception); the few function-local imports of colab_kit modules are declared with their reason;
about eight modules at the top; every ``ck.*`` name resolving; no import hook."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import colab_kit

ROOT = Path(colab_kit.__file__).resolve().parent

LAYERS = (  # bottom to top: a package imports only from its own package and from packages of lower layers
    ("errors", "net"),      # what ranks raise (which rank, why); where sockets listen
    ("config", "launch"),   # ParallelConfig; launch: local ranks, process start-up on errors and net only
    ("part",),              # the shape every parallel part declares in its folder (Part, Build, Rule)
    ("comm", "join"),       # collectives that record; join: ck.init() under torchrun / Slurm / MPI (config, net)
    ("mesh",),              # MeshLayout, ProcessMesh (each mesh keeps its CommLog)
    ("policy",),            # roles by module path; the built-in policies read a model by path, import none
    ("models",),            # GPT, BERT, ViT, their layout-invariant dropout masks (a policy finds HF attentions)
    ("placement", "sharded_init", "measure", "datasets"),  # what the parallel parts share
    ("tensor",),            # the parallel parts, in order: each may import those before it
    ("sequence",),
    ("expert",),            # expert parallelism: the experts over ep, tokens by all-to-all
    ("dropout",),           # DropoutLayout: the coordinates from the tensor and sequence plans
    ("recompute",),
    ("pipeline",),
    ("precision",),
    ("zero",),              # data parallelism and ZeRO; the optimizer rebuilt over the shards
    ("checkpoint", "observe"),  # what an engine saves, what its steps cost: they read an engine, import none
    ("memory",),            # estimates and timelines (a timeline marks observe's engine phases)
    ("engine",),            # boost, Engine: composes every part, reports through the packages below
    ("planner",),           # ck.plan, ck.dry_run: estimates, then runs engines
    ("viz",),               # plotly figures
    ("notebook",),          # magics, widgets, the ipyparallel cluster
    ("colab_kit",),         # colab_kit/__init__.py: the ck.* names
    ("cli",),               # colab-kit demo / plan
)
"""The package layers, also written in docs/layout.md. A top-level module (``config``, ``mesh``, ...) is a package
of its own; ``colab_kit`` is the package's ``__init__``."""

LOCAL_IMPORTS = {  # (importing module, imported module): why the import waits for a call
    ("colab_kit.sequence.ring_kernels", "colab_kit.sequence.ring"):
        "ring imports ring_kernels: the probe's reference is ring's explicit block (a cycle at import time)",
    ("colab_kit", "colab_kit.notebook.magics"):
        "%load_ext colab_kit: IPython and the magics load in a kernel only, not on every import colab_kit",
    ("colab_kit", "colab_kit.notebook.cluster.forked"):
        "%load_ext colab_kit starts the engine fork server: ipyparallel's cluster layer loads in a kernel only",
    ("colab_kit.cli", "colab_kit.viz"): "plotly: the demo's HTML report only (--report '' skips it), not colab-kit plan",
    ("colab_kit.notebook.magics.views", "colab_kit.viz.mesh"): "plotly: when %colossal mesh draws",
    ("colab_kit.notebook.magics.views", "colab_kit.notebook.widgets.memory_view"):
        "ipywidgets and plotly: %colossal memory's widget only (text elsewhere)",
    ("colab_kit.notebook.magics.views", "colab_kit.notebook.widgets.planner_view"):
        "ipywidgets and plotly: %colossal plan's widget only (text elsewhere)",
    ("colab_kit.notebook.magics.views", "colab_kit.notebook.widgets.moe_view"):
        "ipywidgets and plotly: %colossal moe's widget only (text elsewhere)",
    ("colab_kit.notebook.magics.pipeline_views", "colab_kit.viz.pipeline"): "plotly: when a schedule is drawn",
    ("colab_kit.notebook.magics.pipeline_views", "colab_kit.viz.schedule_data"): "plotly (viz's package): idem",
}
"""Every function-local import of a colab_kit module, with its reason: each one loads a heavy or optional
dependency (plotly, ipywidgets, IPython) that the importing module does not load itself."""


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under the package directory ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _package(module: str) -> str:
    """``pkg.tensor.tp1d`` -> ``tensor``; ``pkg.config`` -> ``config``; ``pkg`` -> ``pkg``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(root: Path) -> list[tuple[str, str, int, bool]]:
    """Every import of a module under ``root`` by a module under ``root``, anywhere in the source (inside
    functions and under ``TYPE_CHECKING`` too): ``(importer, imported module, line, inside a function)``.
    ``from pkg import x`` imports the module ``pkg.x`` where there is one, else ``pkg``."""
    known, out = _modules(root), []
    for name, path in sorted(known.items()):
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    anchor = base
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    module = anchor + ("." + module if module else "")
                found = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
            else:
                continue
            for m in found:
                while m and m not in known:
                    m = m.rpartition(".")[0]
                if m and m != name:
                    out.append((name, m, node.lineno, id(node) in local))
    return sorted(set(out))


def layering_errors(root: Path, layers=LAYERS) -> list[str]:
    """Each import that points up or sideways in ``layers`` (or into a package no layer names)."""
    level = {p: i for i, layer in enumerate(layers) for p in layer}
    errors = []
    for pkg in sorted({_package(m) for m in _modules(root)} - set(level)):
        errors.append(f"package {pkg} is in no layer")
    for a, b, line, _ in imports(root):
        pa, pb = _package(a), _package(b)
        if pa == pb or pa not in level or pb not in level:
            continue
        if level[pb] > level[pa]:
            errors.append(f"{a}:{line} imports {b}: {pa} (layer {level[pa]}) points up to {pb} (layer {level[pb]})")
        elif level[pb] == level[pa]:
            errors.append(f"{a}:{line} imports {b}: {pa} and {pb} share layer {level[pa]}, sideways")
    return errors


def local_import_errors(root: Path, declared=LOCAL_IMPORTS) -> list[str]:
    """Function-local imports of the package's modules missing from ``declared``, and declared ones not found."""
    found = {(a, b): line for a, b, line, local in imports(root) if local}
    errors = [f"{a}:{line} imports {b} inside a function: import it at the top, or declare why in LOCAL_IMPORTS"
              for (a, b), line in sorted(found.items()) if (a, b) not in declared]
    errors += [f"LOCAL_IMPORTS lists {a} -> {b}, which no function imports any more" for a, b in sorted(declared)
               if (a, b) not in found]
    return errors


def test_every_import_points_down_the_layers():
    assert len(_modules(ROOT)) > 100  # the whole package was read
    assert layering_errors(ROOT) == []


def import_cycles(root: Path) -> list[list[str]]:
    """Each set of modules under ``root`` that import each other round a circle at module level (an import
    inside a function runs later and closes no circle at import time), each sorted; a package's ``__init__``
    that re-exports its own submodules is a module like any other."""
    graph: dict[str, set[str]] = {}
    for a, b, _, local in imports(root):
        if not local:
            graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_circle():
    """No two modules import each other, directly or round a longer circle (the last one, the memory
    estimator and its experts' estimate, was broken by ``memory.layout``)."""
    assert import_cycles(ROOT) == []


def test_every_function_local_import_is_declared_with_its_reason():
    assert all(why for why in LOCAL_IMPORTS.values())
    assert local_import_errors(ROOT) == []


@pytest.fixture
def toy(tmp_path):
    """A package ``pkg`` with low ``a``, and ``b``, ``c`` side by side above it."""
    for sub in ("a", "b", "c"):
        (tmp_path / "pkg" / sub).mkdir(parents=True)
        (tmp_path / "pkg" / sub / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "b" / "down.py").write_text("from ..a import x\nfrom . import up\n")
    return tmp_path / "pkg", (("a",), ("b", "c"), ("pkg",))


def test_the_layering_check_fails_on_an_import_up_or_sideways(toy):
    """It can fail: ``a`` importing ``b`` inside a function points up; ``b`` importing ``c`` under TYPE_CHECKING
    points sideways; a package in no layer is named."""
    root, layers = toy
    assert layering_errors(root, layers) == []
    (root / "a" / "low.py").write_text("def f():\n    from ..b import down\n")
    (root / "b" / "side.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n")
    (root / "d").mkdir()
    (root / "d" / "__init__.py").write_text("")
    assert layering_errors(root, layers) == [
        "package d is in no layer",
        "pkg.a.low:2 imports pkg.b.down: a (layer 0) points up to b (layer 1)",
        "pkg.b.side:3 imports pkg.c: b and c share layer 1, sideways"]


def test_the_local_import_check_fails_on_an_undeclared_or_stale_one(toy):
    root, _ = toy
    (root / "b" / "late.py").write_text("def f():\n    from ..a import x\n")
    assert local_import_errors(root, {}) == [
        "pkg.b.late:2 imports pkg.a inside a function: import it at the top, or declare why in LOCAL_IMPORTS"]
    assert local_import_errors(root, {("pkg.b.late", "pkg.a"): "why"}) == []
    assert local_import_errors(root, {("pkg.b.late", "pkg.a"): "why", ("pkg.c", "pkg.a"): "gone"}) == [
        "LOCAL_IMPORTS lists pkg.c -> pkg.a, which no function imports any more"]


def test_the_circle_check_finds_a_circle(toy):
    """It can fail: ``b.down`` imports ``b.up``, which imports ``b.down`` back (at module level); the same
    import inside a function closes no circle."""
    root, _ = toy
    (root / "b" / "up.py").write_text("def f():\n    from . import down\n")
    assert import_cycles(root) == []
    (root / "b" / "up.py").write_text("from . import down\n")
    assert import_cycles(root) == [["pkg.b.down", "pkg.b.up"]]


def test_the_top_level_holds_about_eight_modules():
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert top == ["cli", "config", "join", "measure", "mesh", "net", "placement"], top
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert {"engine", "launch", "memory", "notebook", "observe", "tensor", "pipeline", "sequence", "zero"} <= set(packages)


def test_every_public_name_resolves():
    import colab_kit as ck

    for name in ck.__all__ + sorted(ck._LAZY) + sorted(ck._SUBMODULES):
        assert getattr(ck, name) is not None, name
    assert ck.cluster.__name__ == "colab_kit.notebook.cluster" and ck.recipe.__name__ == "colab_kit.models.recipe"



def test_import_installs_no_finder_and_old_paths_are_gone():
    """0.1's module paths were served for one version by a ``sys.meta_path`` finder; that is over. In a fresh
    interpreter: importing the package adds no finder, and an old path fails as any missing module does."""
    code = textwrap.dedent("""
        import sys
        before = list(sys.meta_path)
        import colab_kit
        assert sys.meta_path == before, sys.meta_path
        for old in ("colab_kit.engine_records", "colab_kit.cluster.remote", "colab_kit.data"):
            try:
                __import__(old)
                raise SystemExit(old + " still imports")
            except ModuleNotFoundError:
                pass
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]

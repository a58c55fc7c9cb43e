"""The package's layout holds: no import cycle anywhere in ``colab_kit`` (module-level imports and the ones
inside functions alike), about eight modules at the top, every ``ck.*`` name resolving."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import colab_kit

ROOT = Path(colab_kit.__file__).resolve().parent


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under the package directory ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (not under ``TYPE_CHECKING``).
    ``from pkg import x`` counts as importing ``pkg.x`` where that is a module, else ``pkg``."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base
                    for _ in range(child.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    module = anchor + ("." + child.module if child.module else "")
                else:
                    module = child.module or ""
                found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    edges = set()
    for m in found:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != name:
            edges.add(m)
    return edges


def import_cycles(root: Path) -> list[list[str]]:
    """Every strongly connected group of more than one module in the import graph under ``root`` (Tarjan)."""
    known = _modules(root)
    graph = {m: sorted(_imports(m, p, known)) for m, p in known.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_no_import_cycle_in_the_package():
    assert len(_modules(ROOT)) > 100  # the whole package was read
    assert import_cycles(ROOT) == []


def test_the_cycle_check_catches_one_inside_a_function(tmp_path):
    """It can fail: a lazy import inside a function that closes a loop (``a -> b -> a``) is a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import g\n")
    (pkg / "a.py").write_text("from .sub import g\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n")
    assert import_cycles(pkg) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]


def test_the_top_level_holds_about_eight_modules():
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert top == ["cli", "config", "join", "launch", "measure", "mesh", "net", "placement", "sharded_init"], top
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert {"engine", "memory", "notebook", "observe", "tensor", "pipeline", "sequence", "zero"} <= set(packages)


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
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]

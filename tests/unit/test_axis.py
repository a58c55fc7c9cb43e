"""Mesh axes are named once (``colab_kit.config.Axis``): the layouts report ``Axis`` members, which are
``str`` (user code and tests keep passing ``"dp"``), and the package names an axis through the enum, not
with a bare string literal (an AST scan of the source, which a test shows can fail)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import colab_kit as ck
from colab_kit.config import Axis

PACKAGE = Path(ck.__file__).resolve().parent
VALUES = {a.value for a in Axis}

# Files the scan passes over (none: every file of the package is swept). Paths relative to colab_kit/: a folder
# ends with "/", a bare file name matches in any folder.
UNSWEPT: tuple[str, ...] = ()

# the second argument of these names a ParallelConfig field, not an axis: the attribute of ``getattr(cfg, "ep", 1)``,
# the key of the planner's ``_allowed(restrict, "tp", tp)`` (``restrict``: ParallelConfig field -> allowed values)
_FIELD_NAME_CALLS = {"getattr", "hasattr", "setattr", "delattr", "_allowed"}


def bare_axis_literals(source: str) -> list[tuple[int, str]]:
    """``(line, value)`` of each string literal equal to an axis name used where code names an axis: an
    argument of a call (``comm.all_reduce(g, mesh, "dp")``, ``mesh.size(axis="tp")``), an operand of a
    comparison (``axis == "ep"``), or an element of a tuple / list / set that is one of those
    (``axis in ("ep", "edp")``). Docstrings, comments and message text are not looked at."""
    found = []

    def look(node: ast.AST) -> None:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                look(element)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in VALUES:
            found.append((node.lineno, node.value))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            args = list(node.args)
            if isinstance(node.func, ast.Name) and node.func.id in _FIELD_NAME_CALLS:
                args = args[:1] + args[2:]
            for arg in args + [k.value for k in node.keywords]:
                look(arg)
        elif isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                look(operand)
    return sorted(found)


def _unswept(rel: str) -> bool:
    return any(rel.startswith(u) if u.endswith("/") else rel == u or rel.endswith("/" + u) for u in UNSWEPT)


def test_axis_members_are_exactly_the_mesh_axes():
    assert {a.name: a.value for a in Axis} == {
        "PP": "pp", "DP": "dp", "SP": "sp", "TP": "tp", "EP": "ep", "EDP": "edp", "DP_SP": "dp_sp",
        "TP_ROW": "tp_row", "TP_COL": "tp_col", "TP_DEP": "tp_dep", "TP_IN": "tp_in", "TP_WT": "tp_wt",
        "TP_OUT": "tp_out"}
    assert ck.Axis is Axis and "Axis" in ck.__all__


def test_an_axis_is_its_string():
    assert Axis.DP == "dp" and isinstance(Axis.DP, str) and Axis("edp") is Axis.EDP
    assert str(Axis.DP) == f"{Axis.DP}" == "%s" % Axis.DP == "dp" and type(str(Axis.DP)) is str
    assert {"dp": 1}[Axis.DP] == 1 and {Axis.TP: 2}["tp"] == 2 and hash(Axis.SP) == hash("sp")
    assert json.dumps({Axis.EP: [Axis.EDP]}) == '{"ep": ["edp"]}'
    assert repr(Axis.TP_ROW) == "'tp_row'" and repr((Axis.PP, "dp")) == "('pp', 'dp')"  # prints as before


@pytest.mark.parametrize("config", [ck.ParallelConfig(dp=2, tp=2), ck.ParallelConfig(tp=4, tp_mode="2d"),
                                    ck.ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2),
                                    ck.ParallelConfig(tp=8, tp_mode="3d"),
                                    ck.ParallelConfig(dp=2, ep=2)], ids=lambda c: c.describe())
def test_every_axis_a_layout_reports_is_an_axis(config):
    layout = ck.MeshLayout(config)
    reported = {*layout.axes, *layout.fine_names, *layout.sub, *config.shape}
    for rank in range(layout.world_size):
        reported |= set(layout.all_coords(rank))
    assert reported <= VALUES, reported - VALUES
    assert all(isinstance(a, Axis) for a in reported), [a for a in reported if not isinstance(a, Axis)]
    for axis in layout.axes:  # and a plain string still names the same groups
        assert layout.groups(str(axis)) == layout.groups(Axis(axis))


def test_the_scan_finds_a_bare_axis():
    source = '''
def f(t, mesh, axis, cfg):
    """Sums over "dp" (a docstring: not looked at)."""
    comm.x(t, mesh, "dp")
    if axis in ("ep", "edp") or axis == "tp_row":
        mesh.size(axis="pp")
    getattr(cfg, "ep", 1) and _allowed(restrict, "tp", 2)  # field names
    raise ValueError("no dp axis here: dp")
    comm.y(t, mesh, rows=("tp_wt", "tp_in"), hidden="tp_out")
    return comm.x(t, mesh, Axis.DP), mesh.rank(axis)
'''
    assert bare_axis_literals(source) == [(4, "dp"), (5, "edp"), (5, "ep"), (5, "tp_row"), (6, "pp"),
                                          (9, "tp_in"), (9, "tp_out"), (9, "tp_wt")]


def test_the_package_names_axes_through_the_enum():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if not _unswept(p.relative_to(PACKAGE).as_posix())]
    assert len(files) > 100 and any(p.name == "part.py" for p in files)
    assert any("planner" in p.parts for p in files) and any(p.name == "tp3d_layers.py" for p in files)
    bare = [f"colab_kit/{p.relative_to(PACKAGE).as_posix()}:{line}: {value!r}"
            for p in files for line, value in bare_axis_literals(p.read_text(encoding="utf-8"))]
    assert not bare, "name the axis with colab_kit.config.Axis (Axis.DP, ...):\n" + "\n".join(bare)

"""A failing rank's traceback quotes the user's source lines (issue 7).

cloudpickle >= 3.1 renames code it pickles by value to "<dynamic-code>", and a notebook
cell's "file" (``/tmp/ipykernel_<pid>/<hash>.py``) exists only in the kernel's
``linecache``; either way a rank's traceback lost the lines the user wrote. The cases:
a function of this module (pickled by value), a closure, a lambda, and a simulated
notebook cell (nested code, closure and lambda), through ``ck.launch`` and through a
cluster's ``run``. The in-process tests check ``colab_kit.errors.tracebacks`` itself.
"""
from __future__ import annotations

import linecache
import os
import re
import sys
import uuid
from textwrap import dedent

import cloudpickle
import pytest
import torch.distributed as dist

import colab_kit as ck
from colab_kit.errors import tracebacks
from colab_kit.errors import RankError

# rank functions travel by value (as a notebook's do): the ranks need not import this module
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --------------------------------------------------------------------------- rank functions
def fails_on_1():
    if dist.get_rank() == 1:
        raise ValueError("module function fails on rank 1")
    return "ok"


def make_closure(msg):
    def closure():
        if dist.get_rank() == 1:
            raise KeyError(f"closure over {msg}")
        return msg

    return closure


failing_lambda = lambda: 1 / (dist.get_rank() - 1)  # noqa: E731  (ZeroDivisionError on rank 1)

CELL = '''\
def cell_step(kind):
    import torch.distributed as dist

    def check(rank):
        if rank == 1:
            raise RuntimeError(f"cell check failed: {kind}")
        return kind

    pick = lambda: check(dist.get_rank())
    return pick()
'''


def notebook_cell(source: str = CELL) -> tuple[str, dict]:
    """Run ``source`` as ipykernel runs a cell: compiled under a file name that exists only in
    this process's ``linecache``, in a ``__main__`` namespace. Returns (file name, namespace)."""
    name = f"/tmp/ipykernel_{os.getpid()}/{uuid.uuid4().int % 10**10}.py"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), ns)
    return name, ns


HERE = fails_on_1.__code__.co_filename


def cases():
    """(function, expected [(file, function name, source line)] in the failing rank's traceback)."""
    cell, ns = notebook_cell()
    return {
        "module function": (fails_on_1, [(HERE, "fails_on_1", 'raise ValueError("module function fails on rank 1")')]),
        "closure": (make_closure("x"), [(HERE, "closure", 'raise KeyError(f"closure over {msg}")')]),
        "lambda": (failing_lambda, [(HERE, "<lambda>", "failing_lambda = lambda: 1 / (dist.get_rank() - 1)")]),
        "notebook cell": (ns["cell_step"], [(cell, "cell_step", "return pick()"),
                                            (cell, "<lambda>", "pick = lambda: check(dist.get_rank())"),
                                            (cell, "check", 'raise RuntimeError(f"cell check failed: {kind}")')]),
    }


def assert_quotes(tb: str, frames) -> None:
    """Each frame's header names the real file and function, and the next line is its source."""
    for filename, func, line in frames:
        header = f'  File "{filename}", line '
        assert re.search(re.escape(header) + r"\d+, in " + re.escape(func) + r"\n\s+" + re.escape(line), tb), (
            f"no frame of {func} in {filename} quoting {line!r} in:\n{tb}")
    assert "<dynamic-code>" not in tb


# --------------------------------------------------------------------------- through ck.launch
@pytest.mark.parametrize("case", ["module function", "closure", "lambda", "notebook cell"])
def test_launch_traceback_quotes_the_source(case):
    fn, frames = cases()[case]
    cell_args = ("kind-a",) if case == "notebook cell" else ()
    with pytest.raises(RankError) as info:
        ck.launch(fn, 2, *cell_args, timeout=120)
    assert list(info.value.failures) == [1]
    assert_quotes(info.value.failures[1], frames)


# --------------------------------------------------------------------------- through a cluster
def test_cluster_run_traceback_quotes_the_source(cluster):
    # the test module's functions are imported by the engines (their file is on this host's
    # disk); the notebook cell's lines exist only in this process and must travel
    for case, (fn, frames) in cases().items():
        cell_args = ("kind-b",) if case == "notebook cell" else ()
        with pytest.raises(RankError) as info:
            cluster.run(fn, *cell_args, timeout=120)
        assert list(info.value.failures) == [1], case
        assert_quotes(info.value.failures[1], frames)
        assert not cluster.needs_restart


# --------------------------------------------------------------------------- the module, in process
def test_pack_keeps_file_names_and_sends_the_lines():
    name, ns = notebook_cell()
    data = tracebacks.pack((ns["cell_step"], ("k",)))
    del linecache.cache[name]  # as on a rank: the cell's "file" is unknown there
    fn, args = tracebacks.unpack(data)
    assert args == ("k",)
    nested = [c for c in fn.__code__.co_consts if hasattr(c, "co_filename")]
    assert {c.co_name for c in nested} == {"check", "<lambda>"}
    assert {fn.__code__.co_filename, *(c.co_filename for c in nested)} == {name}
    assert linecache.getlines(name) == CELL.splitlines(True)


def test_plain_cloudpickle_renames_code_by_value():
    """Why pack exists: what a fresh install's cloudpickle does to a function sent by value."""
    name, ns = notebook_cell()
    fn = cloudpickle.loads(cloudpickle.dumps(ns["cell_step"]))
    if fn.__code__.co_filename == name:
        pytest.skip(f"cloudpickle {cloudpickle.__version__} keeps file names")
    assert fn.__code__.co_filename == "<dynamic-code>"


def test_source_map_follows_user_code_only():
    name, ns = notebook_cell(dedent('''\
        def helper():
            return 1
        def outer(f=helper):
            return helper() + dedent("x")
        '''))
    ns["dedent"] = dedent  # a library function named by the cell: its file is not sent
    sources = tracebacks.source_map(ns["outer"], [make_closure("y")])
    assert set(sources) == {name, HERE}
    assert sources[name][0] == "def helper():\n"


def test_install_adds_missing_lines_and_leaves_readable_files_alone():
    name = f"/nowhere/{uuid.uuid4().hex}.py"
    here = linecache.getlines(HERE)
    tracebacks.install({name: ["x = 1\n"], HERE: list(here)})
    assert linecache.getline(name, 1) == "x = 1\n"
    assert linecache.cache[HERE][1] is not None  # still the file's own entry (with its mtime)
    del linecache.cache[name]


def test_a_module_of_a_module_subclass_travels_by_reference():
    """``torch.backends.cudnn`` is a ``CudnnModule``: a rank function that sets ``cudnn.allow_tf32`` used to be
    refused by ck.launch ("cannot pickle 'CudnnModule' object"); it goes by name, as plain modules do."""
    import torch.backends
    import torch.backends.cudnn as cudnn

    from colab_kit.errors.tracebacks import pack, unpack
    assert unpack(pack((cudnn, torch.backends))) == (cudnn, torch.backends)

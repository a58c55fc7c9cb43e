"""A failing rank's traceback quotes the user's source lines, wherever the code came from.

Code sent to the ranks often comes from a file the ranks cannot read: a notebook cell
(IPython keeps the cell's text in the kernel's ``linecache`` under a name such as
``/tmp/ipykernel_4242/3051047417.py``, a file that exists nowhere), a script's
``__main__``, or another host's disk. And cloudpickle >= 3.1 renames every code object
it pickles by value to ``"<dynamic-code>"``, so a rank would report
``File "<dynamic-code>", line 2, in step`` with no line under it. Two halves put it back:

* ``pack(obj) -> bytes`` / ``unpack(data) -> obj`` (``ck.launch``): cloudpickle, except
  that every code object keeps its file name, and the lines of each file such code comes
  from travel along; ``unpack`` registers them in the rank's ``linecache`` first.
* ``source_map(*objs) -> {filename: lines}`` / ``install(sources)`` (``Cluster.run``:
  ipyparallel pickles code with its file name; only the lines are missing).

Worked example: a cell defines ``step``; ``ck.launch(step, 2)`` runs it::

    In [3]: def step():
       ...:     raise ValueError("bad batch")
    # step.__code__.co_filename == "/tmp/ipykernel_4242/3051047417.py"
    data = pack((step, ()))     # ({"/tmp/ipykernel_4242/3051047417.py":
                                #    ["def step():\\n", '    raise ValueError("bad batch")\\n']},
                                #   cloudpickle bytes whose code objects keep that file name)
    fn, args = unpack(data)     # on a rank: linecache now holds the cell's two lines
    fn()                        #   File "/tmp/ipykernel_4242/3051047417.py", line 2, in step
                                #     raise ValueError("bad batch")

A file the rank can already read with the same lines is left alone; lines it reads
differently (or not at all) are replaced by the kernel's, i.e. those of the code that runs.
"""
from __future__ import annotations

import functools
import importlib
import io
import linecache
import pickle
import sys
import types
from collections import ChainMap
from itertools import islice
from typing import Any

import cloudpickle

__all__ = ["pack", "unpack", "source_map", "install"]

# cloudpickle's own code reducer (the one that writes "<dynamic-code>"); None if it has none
_CODE_REDUCE = getattr(cloudpickle.Pickler, "dispatch_table", {}).get(types.CodeType)


def _code(ctor, args, filename: str) -> types.CodeType:
    """Rebuild a code object as cloudpickle would, then give it back its file name."""
    code = ctor(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle that records, and keeps, the file name of every code object it sends by value."""

    def __init__(self, file):
        self.files: set[str] = set()
        if _CODE_REDUCE is not None:  # read by pickle.Pickler.__init__, so set before it
            self.dispatch_table = ChainMap({types.CodeType: self._reduce_code}, cloudpickle.Pickler.dispatch_table)
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj):
        """A module of a ModuleType subclass (``torch.backends.cudnn`` is a ``CudnnModule``, whose settings are
        properties) by reference, as cloudpickle sends plain modules: it would try to pickle it by value."""
        if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                and sys.modules.get(obj.__name__) is obj):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)

    def _reduce_code(self, code):
        self.files.add(code.co_filename)
        assert _CODE_REDUCE is not None  # installed only where cloudpickle has one
        ctor, args = _CODE_REDUCE(code)  # nested code objects (in co_consts) come back through here
        return _code, (ctor, args, code.co_filename)


def pack(obj) -> bytes:
    """``obj`` (e.g. ``(fn, args)``) pickled for a rank, with the sources its tracebacks need."""
    body = io.BytesIO()
    pickler = _Pickler(body)
    pickler.dump(obj)
    return pickle.dumps((_lines(pickler.files), body.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes):
    """On the rank: register the sources in ``linecache``, then load the object."""
    sources, body = pickle.loads(data)
    install(sources)
    return pickle.loads(body)


_WALK_LIMIT = 10_000  # objects looked at: a long list of numbers among the arguments is not searched through


def source_map(*objs) -> dict[str, list[str]]:
    """{file name: lines} of the code in ``objs``: functions (their nested code, closures,
    defaults, and the functions and classes of their own module they name), bound methods,
    partials, classes defined with them, and containers of these."""
    files: set[str] = set()
    seen: set[int] = set()
    todo: list[tuple[Any, str | None]] = [(o, None) for o in objs]  # (object, module it was reached from, None = any)
    while todo and len(seen) < _WALK_LIMIT:
        obj, module = todo.pop()
        if id(obj) in seen or (module is not None and getattr(obj, "__module__", module) != module):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            names = _code_files(obj.__code__, files)
            cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            found = [obj.__globals__[n] for n in names if n in obj.__globals__]
            todo += [(o, None) for o in cells + list(obj.__defaults__ or ())]
            todo += [(o, obj.__module__) for o in found if isinstance(o, (types.FunctionType, type))]
        elif isinstance(obj, types.MethodType):
            todo.append((obj.__func__, None))
        elif isinstance(obj, functools.partial):
            todo += [(o, None) for o in (obj.func, *obj.args, *obj.keywords.values())]
        elif isinstance(obj, type) and obj.__module__ != "builtins":
            todo += [(vars(obj)[k], obj.__module__) for k in vars(obj) if isinstance(vars(obj)[k], types.FunctionType)]
        elif isinstance(obj, (list, tuple, set, frozenset, dict)):
            todo += [(o, None) for o in islice(obj.values() if isinstance(obj, dict) else obj, _WALK_LIMIT)]
    return _lines(files)


def install(sources: dict[str, list[str]] | None) -> None:
    """Make ``linecache`` (hence tracebacks and ``inspect.getsource``) give these lines."""
    for filename, lines in (sources or {}).items():
        if lines and linecache.getlines(filename) != lines:
            # mtime None: linecache.checkcache keeps the entry (as IPython does for its cells)
            linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)


def _code_files(code: types.CodeType, files: set[str]) -> set[str]:
    """Add the file names of ``code`` and its nested code to ``files``; return the global names used."""
    files.add(code.co_filename)
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_files(const, files)
    return names


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell (a closure variable not assigned yet)
        return False
    return True


def _lines(files) -> dict[str, list[str]]:
    return {f: lines for f in sorted(files) if (lines := linecache.getlines(f))}

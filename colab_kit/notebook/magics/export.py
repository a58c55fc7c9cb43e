"""``%colossal export PATH`` (and ``ck.export``): what the cluster ran, as a script for torchrun or srun.

The magics record, in order, every config set on the ranks and every ``%%colossal`` cell that ran
without an error (``ColossalState.recorded``). ``export`` writes them as one Python script that starts
with ``ck.init(config)`` and defines what the magic predefines on every rank (``rank``, ``config``,
``mesh``), a Slurm batch file beside it, and returns the torchrun command. A cell is copied byte for byte
(its strings too); one run with ``--ranks 0,2`` runs its exact text under ``if rank in (0, 2):``; a config
set later rebuilds ``config`` and ``mesh`` where it was set; a restart is a comment (the script's ranks
never died). Lines that are IPython syntax (``%time``, ``!ls``) cannot run in a plain script: IPython's
own transformation finds them, each becomes ``pass`` with its text as a comment, and the magic says which.
The script is checked to parse before it is written.

Where it is written (``script_path``): ``PATH`` ending in ``.py`` is the script; ``PATH`` without a suffix gets
``.py`` (``train`` -> ``train.py``), and so does a name with a dot in it (``run.v2`` -> ``run.v2.py``); an
existing folder gets ``train.py`` inside it (``export runs/`` -> ``runs/train.py``); the suffix of a file that
is no script (``train.txt``, ``.ipynb``, ``.sh``: ``NOT_SCRIPTS``) is refused, as torchrun and srun are given a
``.py`` script (``train.txt.py`` would not be what was typed). ``~`` is the home folder. A folder that does not
exist, or that cannot be written, is refused before anything is written (``ConfigError`` saying which).

Worked example, after ``%colossal config dp=2 tp=2`` and one cell ``engine = ck.boost(...)``::

    config = ck.ParallelConfig(dp=2, tp=2)                     # %colossal config dp=2 tp=2
    ck.init(config)                                            # torchrun / srun / mpirun
    rank = torch.distributed.get_rank()
    mesh = ck.ProcessMesh.shared(config)
    # ---- %%colossal cell 1
    engine = ck.boost(...)

    $ torchrun --nproc-per-node 4 train.py        (or: sbatch train.sbatch)
"""
from __future__ import annotations

import os
import time

from ...config import ConfigError, ParallelConfig
from ..session import current

__all__ = ["export", "export_script", "write_export", "script_path"]

DEFAULT_NAME = "train.py"
"""The script's name when ``PATH`` is a folder."""
NOT_SCRIPTS = frozenset({".txt", ".ipynb", ".sh", ".sbatch", ".json", ".md", ".yaml", ".yml", ".toml", ".cfg",
                         ".ini", ".csv", ".log", ".pyc", ".out", ".err"})
"""Suffixes of files that are not a script (refused, not given a .py); any other dot is part of the name."""

_HEADER = '''"""Exported by colab_kit's %colossal export on {when}: the configs and the %%colossal cells the notebook's
cluster ran, in order, as one script.

    {torchrun}
    sbatch {sbatch}
"""
import torch
import torch.distributed

import colab_kit as ck

'''


def _plain_python(source: str) -> tuple[str, list[str]]:
    """``source`` as plain Python: unchanged where it is (byte for byte: strings keep their contents), else
    IPython's own transformation with each line that needs IPython (``%time``, ``!ls``, ``x?``) replaced by
    ``pass`` at its indentation (so a block stays a block) and its text kept as a comment."""
    from IPython.core.inputtransformer2 import TransformerManager
    code = TransformerManager().transform_cell(source)
    if "get_ipython()" not in code:
        return source, []
    out, skipped = [], []
    lines, original = code.splitlines(), source.splitlines()
    same = len(lines) == len(original)  # line for line (line magics, shell escapes): quote what was typed
    for i, line in enumerate(lines):
        if "get_ipython()" in line:
            indent = line[:len(line) - len(line.lstrip())]
            said = original[i].strip() if same else line.strip()
            skipped.append(said)
            out.append(f"{indent}pass  # (IPython syntax, not run by the script) {said}")
        else:
            out.append(line)
    return "\n".join(out) + "\n", skipped


def _config_lines(cfg: dict, first: bool) -> list[str]:
    defaults = ParallelConfig().to_dict()
    args = ", ".join(f"{k}={v!r}" for k, v in cfg.items() if defaults.get(k, object()) != v)
    lines = [f"config = ck.ParallelConfig({args})"]
    if first:
        lines += ["ck.init(config)                     # torchrun / srun / mpirun: joins their process group",
                  "rank = torch.distributed.get_rank()",
                  "mesh = ck.ProcessMesh.shared(config)"]
    else:
        lines += ["if mesh is not None:", "    mesh.release()", "mesh = ck.ProcessMesh.shared(config)"]
    return lines


def export_script(recorded: list[tuple], world_size: int | None = None) -> tuple[str, int, list[str]]:
    """The script's body from ``recorded`` (``("config", dict)``, ``("cell", source, ranks)``,
    ``("restart",)``), its world size (the first config's; ``world_size`` where cells ran before any
    config), and the IPython lines it had to leave out. The body is checked to parse."""
    import ast


    configs = [r[1] for r in recorded if r[0] == "config"]
    if not any(r[0] == "cell" for r in recorded):
        raise ConfigError("nothing to export yet: run %%colossal cells first (after %colossal config dp=4)")
    world = ParallelConfig(**configs[0]).world_size if configs else world_size
    if world is None:
        raise ConfigError("the cells ran before any config and the cluster's size is not known: export from a "
                          "running cluster, or set a config first")
    out, skipped, cells, first = [], [], 0, True
    if recorded[0][0] != "config":  # cells before any config: the magic predefines config = mesh = None
        out += ["ck.init()                           # torchrun / srun / mpirun: joins their process group",
                "rank = torch.distributed.get_rank()", "config = mesh = None"]
        first = False
    for entry in recorded:
        if entry[0] == "config":
            out += ["", f"# ---- config: {ParallelConfig(**entry[1]).describe()}",
                    *_config_lines(entry[1], first and not out)]
            first = False
        elif entry[0] == "restart":
            out += ["", "# ---- %colossal restart (here the ranks never stopped: what the cells before defined stays)"]
        elif entry[0] == "cell":
            cells += 1
            source, ranks = entry[1], entry[2]
            code, left = _plain_python(source)
            skipped += left
            out += ["", f"# ---- %%colossal cell {cells}" + (f" --ranks {','.join(map(str, ranks))}" if ranks else "")]
            if ranks is None:
                out.append(code.rstrip("\n"))
            else:  # the cell's text exactly as it ran, on those ranks only
                out += [f"if rank in {tuple(ranks)}:",
                        f"    exec(compile({code!r}, '<colossal cell {cells}>', 'exec'))"]
    body = "\n".join(out) + "\n"
    try:
        ast.parse(body)
    except SyntaxError as exc:
        raise ConfigError(f"the exported script would not parse ({exc.msg}, line {exc.lineno}): a cell holds "
                          f"code a script cannot run") from None
    return body, world, skipped


def script_path(path) -> tuple[str, bool]:
    """``(absolute path of the script, whether PATH was a folder)`` by the rules in the module docstring;
    ``ConfigError`` saying what would work where the folder is missing or not writable, or the suffix is not .py."""
    given = os.fspath(path)
    full = os.path.abspath(os.path.expanduser(given))
    if os.path.isdir(full):
        folder, full = True, os.path.join(full, DEFAULT_NAME)
    elif given.endswith(("/", os.sep)):
        raise ConfigError(f"the folder {full} does not exist: create it first (mkdir -p {full}), or give a script "
                          f"in an existing folder, e.g. {DEFAULT_NAME}")
    else:
        folder = False
        stem, suffix = os.path.splitext(full)
        if suffix.lower() in NOT_SCRIPTS:
            raise ConfigError(f"{given!r} has the suffix {suffix!r}: the script must be a .py file (torchrun and "
                              f"srun run it with python): try {os.path.splitext(given)[0]}.py, or a folder to write "
                              f"{DEFAULT_NAME} in")
        if suffix.lower() != ".py":  # none, or a dot in the name (run.v2): the script is that name + .py
            full += ".py"
    where = os.path.dirname(full)
    if not os.path.isdir(where):
        near = where
        while not os.path.isdir(near):  # the deepest folder that does exist
            if os.path.exists(near):
                raise ConfigError(f"{near} is a file, not a folder: give a path in a folder, e.g. "
                                  f"{os.path.join(os.path.dirname(near), DEFAULT_NAME)}")
            near = os.path.dirname(near)
        raise ConfigError(f"the folder {where} does not exist (the nearest that does is {near}): create it first "
                          f"(mkdir -p {where}), or give a path in an existing folder, e.g. {DEFAULT_NAME}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(f"the folder {where} is not writable: give a path in a folder you can write, e.g. "
                          f"{os.path.join(os.path.expanduser('~'), DEFAULT_NAME)} or /tmp/{DEFAULT_NAME}")
    if os.path.isdir(full):  # a folder named like the script: its train.py is what a folder gets
        raise ConfigError(f"{full} is a folder: give the script another name, or the folder itself to write "
                          f"{DEFAULT_NAME} in")
    return full, folder


def write_export(recorded: list[tuple], path, world_size: int | None = None) -> dict:
    """Write the script (where ``script_path`` puts ``path``) and ``<script without .py>.sbatch``; return
    ``{"script", "sbatch", "torchrun", "world_size", "skipped", "folder"}`` (``folder``: PATH was a folder)."""
    path, folder = script_path(path)
    body, world, skipped = export_script(recorded, world_size)
    sbatch = path[:-3] + ".sbatch"
    torchrun = f"torchrun --nproc-per-node {world} {os.path.basename(path)}"
    with open(path, "w", encoding="utf-8") as f:
        f.write(_HEADER.format(when=time.strftime("%Y-%m-%d %H:%M"), torchrun=torchrun,
                               sbatch=os.path.basename(sbatch)) + body.lstrip("\n"))
    with open(sbatch, "w", encoding="utf-8") as f:
        f.write(f"#!/bin/bash\n#SBATCH --job-name={os.path.basename(path)[:-3]}\n#SBATCH --ntasks={world}\n"
                f"#SBATCH --time=01:00:00\n# one task per GPU where there are GPUs: add --gpus-per-task=1\n"
                f"# ck.init() reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the first host of the node list\n"
                f"srun python {os.path.basename(path)}\n")
    return {"script": path, "sbatch": sbatch, "torchrun": torchrun, "world_size": world, "skipped": skipped,
            "folder": folder}


def export(path, state=None) -> dict:
    """``ck.export(PATH)``: what ``%colossal export PATH`` writes, from the magics' state (or ``state``)."""
    if state is None:
        state = current()
    cluster = state.cluster
    return write_export(state.recorded, path, cluster.world_size if cluster is not None and cluster.running else None)

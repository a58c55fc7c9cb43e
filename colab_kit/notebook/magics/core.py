"""``%colossal`` and ``%%colossal``: drive a ``ck.Cluster`` from a notebook.

    %load_ext colab_kit
    %colossal start -n 4              # 4 engines, torch.distributed up; shows rank, host, pid, device
    %colossal config dp=2 tp=2        # checked in the kernel first, then set on every rank (+ mesh)
    %colossal mesh --axis tp          # plotly figure of the device mesh (no cluster needed)
    %colossal mesh --axis experts dp=4 ep=2   # dense groups beside the expert groups (ep, edp)
    %colossal schedule --pp 4 --microbatches 8 --schedule zb-h1   # planned grid, bubble (no cluster)
    %colossal timeline --var engine   # the last step of `engine` on every rank (measured)
    %colossal profile --data batch    # one step of `engine` on `batch` under torch.profiler, every rank
    %colossal memory --by place       # memory per rank, measured beside the estimate (MemoryView)
    %colossal memory --timeline       # one step of `engine` on `batch`: bytes by category after every op
    %colossal moe --layer 1           # MoE: each expert's load per step, the all-to-all traffic (MoEView)
    %colossal plan --model MODEL --batch 16 --memory 64MiB   # candidates, estimated (PlannerView)
    %colossal export runs/train.py    # what the cluster ran, as a script (+ runs/train.sbatch) for torchrun / srun
    %colossal status | stop | restart

    %%colossal --ranks 0,2 --timeout 30
    print(rank, mesh.ranks("tp"))     # runs on ranks 0 and 2; rank, config, mesh are predefined

With ``config dp=2 tp=2`` on 4 ranks the cell above prints, grouped per rank::

    [rank 0]
    0 [0, 1]
    [rank 2]
    2 [2, 3]

Ranks whose output is identical are shown once (``[ranks 0, 1, 2, 3]``). In a notebook
a cell that runs longer than 2 s shows a live line meanwhile (the last line a rank
printed), replaced by the grouped output at the end. A rank that
raises is shown with its traceback; the call returns after a short grace period even
when the other ranks wait for it in a collective (then ``%colossal restart``); the
``RankError`` then renders as its summary alone (``_render_traceback_``).
Bad input (unknown subcommand or flag, invalid config, a config key given twice, bad
``--ranks``, a timeout <= 0, world size mismatch, no cluster) is a ``UsageError``: one
clear paragraph, not a traceback, and the cluster stays usable. ``%colossal?`` lists
every subcommand and flag; ``-h`` after a subcommand (or on ``%%colossal``) shows its
help. ``start`` and ``restart`` show a live line in a notebook (engines registered,
torch.distributed ready). The magics act on one explicit ``ColossalState``
(``colab_kit.notebook.session()`` returns the shell's).

Flags naming one of a fixed set (``--schedule 1F1B``, ``--axis DP``, ``--by PLACE``) read any case, as
``%colossal config`` does; the advice in an error is written in the subcommand's flags (``try --chunks 2``).
``export PATH``: a ``.py`` file, a name without suffix (``.py`` added) or an existing folder (``train.py`` in
it); another suffix, a missing or unwritable folder is a ``UsageError`` (``export.script_path``). A ``--var``
that holds no engine on the ranks is told what it holds (``'data' ... holds a tuple, not an engine``) and
which variables do hold engines. ``%unload_ext`` / ``%reload_ext colab_kit`` stop the running cluster and drop
the kept config, saying so in one line (``unload_ipython_extension``).
"""
from __future__ import annotations

import difflib
import os
import re
import sys
import time
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from ..cluster import ClusterError
from ...config import ConfigError, ParallelConfig
from ...errors import MessageOnly, RankError
from .flags import COMMANDS, HELP, cell_parser, command_parser, help_text, split, wants_help
from ..progress import Progress, StageProgress
from .output import show_outputs
from .training import ask_training, summary_lines
from ..session import ColossalState, current
from .export import write_export
from .views import ViewCommands

if TYPE_CHECKING:
    from ..widgets.memory_view import MemoryView
    from ..widgets.moe_view import MoEView

__all__ = ["ColossalState", "ColossalMagics", "state", "show_outputs", "load_ipython_extension",
           "unload_ipython_extension"]


# ---------------------------------------------------------------- the magics
class CellInterrupted(MessageOnly, KeyboardInterrupt):
    """A Ctrl-C (or the stop button) during a ``%%colossal`` cell, raised once every rank's output and the
    cluster's health check are printed: IPython shows its one line, not the kernel-side frames of the wait.
    ``outputs`` and ``cluster_status`` as on the ``KeyboardInterrupt`` ``Cluster.execute`` raises."""

    outputs: dict | None = None
    cluster_status: str | None = None


@magics_class
class ColossalMagics(ViewCommands, Magics):
    """``%colossal`` / ``%%colossal``, bound to one explicit ``ColossalState``; the subcommands that draw are
    ``ViewCommands``'s (``views.py``)."""

    def __init__(self, shell, state: ColossalState):
        super().__init__(shell)
        self.state = state
        # the MemoryView %colossal memory showed last (it watches until replaced)
        self._memory_view: MemoryView | None = None
        self._moe_view: MoEView | None = None  # the same for %colossal moe

    @line_cell_magic
    def colossal(self, line: str, cell: str | None = None):
        try:
            return self._line(line) if cell is None else self._cell(line, cell)
        except (ConfigError, ClusterError) as exc:  # bad input: one paragraph, no traceback
            raise UsageError(str(exc)) from None

    def _line(self, line: str):
        argv = split(line, "%colossal")
        if not argv or argv[0] in ("help", *HELP):
            topic = argv[1] if argv[1:] and argv[1] not in HELP else None  # help -h: the whole help
            if topic is not None and topic not in COMMANDS:
                raise UsageError(f"%colossal help: {topic!r} is not a subcommand{_near(topic)}. Subcommands: "
                                 f"{', '.join(COMMANDS)} (%colossal help alone lists them all with their flags)")
            print(command_parser(topic).format_help() if topic else help_text())
            return None
        name, rest = argv[0], argv[1:]
        if name not in COMMANDS:
            raise UsageError(f"%colossal: unknown subcommand {name!r}{_near(name)}. Subcommands: {', '.join(COMMANDS)}")
        p = command_parser(name)
        if wants_help(rest):  # that subcommand's usage and help, and nothing else
            print(p.format_help())
            return None
        if not COMMANDS[name][1]:
            return getattr(self, f"_do_{name}")(p.parse_args(rest), [])
        args, words = p.parse_known_args(rest)
        try:
            return getattr(self, f"_do_{name}")(args, words)
        except ConfigError as exc:
            if not str(exc).startswith(("unknown config key", "cannot read", "flag ")):
                raise
            raise UsageError(f"{exc}. Usage: {p.usage_line()}") from None  # a word it could not read

    @property
    def _notebook(self) -> bool:
        """Live progress lines only where a kernel shows them; a plain terminal gets the result alone."""
        return getattr(self.shell, "kernel", None) is not None

    def _live(self, what: str) -> StageProgress | None:
        return StageProgress(what) if self._notebook else None

    def _do_start(self, args, words):
        t0 = time.perf_counter()
        progress = self._live("starting the cluster")
        try:
            cluster = self.state.start(args.n, args.engines, args.timeout, progress=progress, ip=args.ip,
                                       hosts=args.hosts, profile=args.profile, fit=args.fit)
        finally:
            if progress is not None:
                progress.close()
        backend = cluster.ranks()[0]["backend"]
        if cluster.fit_note:
            print(cluster.fit_note)
        print(f"started {cluster.world_size} ranks ({args.engines} engines, {backend}) "
              f"in {time.perf_counter() - t0:.1f} s")
        display(cluster.ranks())
        if self.state.dropped is not None:
            print(f"the kept config ({self.state.dropped.describe()}) does not fit {cluster.world_size} ranks and was "
                  "dropped: set one with %colossal config")

    def _do_config(self, args, words):
        if not words:
            cfg = self.state.config
            print(f"config: {cfg.describe()}\n{cfg}" if cfg else "no config set: try %colossal config dp=4")
            return
        config = ParallelConfig.parse(words)  # validated in the kernel, before any engine
        print(self.state.apply_config(config))

    def _do_status(self, args, words):
        cluster = self.state.cluster
        print(cluster.status() if cluster is not None else "no cluster running")
        if cluster is not None and cluster.running:
            display(cluster.ranks())
        if self.state.config is not None and (cluster is None or not cluster.running):
            print(f"kept config: {self.state.config.describe()}")

    def _do_export(self, args, words):
        """Write what the cluster ran as a script for torchrun / srun (``colab_kit.notebook.magics.export``).

        PATH: ``train.py``; ``train`` (``.py`` added); an existing folder (``train.py`` written in it, and the
        output says so); another suffix is refused, as is a folder that does not exist or cannot be written
        (``export.script_path``): each a ``UsageError`` saying what would work, nothing written."""
        try:
            cluster = self.state.cluster
            out = write_export(self.state.recorded, args.path,
                               cluster.world_size if cluster is not None and cluster.running else None)
        except ValueError as exc:  # ConfigError: nothing to export yet, or a PATH it cannot write
            raise UsageError(f"%colossal export: {exc}") from None
        except OSError as exc:  # what the checks before writing could not foresee (a full disk, a read-only file)
            raise UsageError(f"%colossal export: cannot write {exc.filename or args.path}: "
                             f"{exc.strerror or exc}") from None
        if out.get("folder"):
            print(f"{args.path} is a folder: the script is {os.path.basename(out['script'])} in it")
        print(f"wrote {out['script']} and {out['sbatch']}: run it with\n  {out['torchrun']}\n  sbatch "
              f"{os.path.basename(out['sbatch'])}")
        if out["skipped"]:
            print(f"IPython lines left as comments (a script cannot run them): {'; '.join(out['skipped'])}")
        return None

    def _do_stop(self, args, words):
        self.state.stop()
        print("cluster stopped")

    def _do_restart(self, args, words):
        t0 = time.perf_counter()
        progress = self._live("restarting the cluster")
        try:
            cluster = self.state.restart(progress=progress)
        finally:
            if progress is not None:
                progress.close()
        print(f"restarted {cluster.world_size} ranks in {time.perf_counter() - t0:.1f} s"
              + (f" with config {cluster.config.describe()}" if cluster.config else ""))
        display(cluster.ranks())

    def _kernel_names(self, err: RankError) -> list[str]:
        """A hint for each name a rank found undefined that this kernel defines: a ``%%colossal`` cell runs in
        each rank's own namespace, not the kernel's."""
        ns = getattr(self.shell, "user_ns", None) or {}
        names = sorted({m.group(1) for text in err.failures.values()
                        for m in re.finditer(r"NameError: name '(\w+)' is not defined", str(text))})
        return [f"{name!r} is a variable of this kernel, not of the ranks: a %%colossal cell runs in each rank's own "
                f"namespace; define it in a %%colossal cell (as the kernel's cells do for themselves)"
                for name in names if name in ns]

    def _cell(self, line: str, cell: str):
        p, argv = cell_parser(), split(line, "%%colossal")
        if wants_help(argv):  # the help, and the cell is not run
            print(p.format_help())
            return
        args = p.parse_args(argv)
        cluster = self.state.require_cluster()
        progress = Progress(cluster.world_size if args.ranks is None else len(args.ranks)) if self._notebook else None
        asked = []  # rank 0's answer to what the cell trained, asked right behind the cell (training.py)
        sent = (lambda: asked.append(ask_training(cluster))) if args.ranks is None or 0 in args.ranks else None
        try:
            self.state.last = cluster.execute(cell, ranks=args.ranks, timeout=args.timeout, where="%%colossal",
                                              progress=progress, sent=sent)
        except RankError as err:
            self.state.last = getattr(err, "outputs", None)
            if self.state.last:
                show_outputs(self.state.last)
                err.shown = True
            for hint in self._kernel_names(err):
                print(hint, file=sys.stderr)
            raise err from None
        except KeyboardInterrupt as stop:  # Ctrl-C / the stop button: what every rank said so far, then
            self.state.last = getattr(stop, "outputs", None)  # whether the ranks are still in step
            if self.state.last:
                show_outputs(self.state.last)
            status = getattr(stop, "cluster_status", None)  # set by Cluster.execute
            if status:
                print(f"interrupted; cluster: {status}", file=sys.stderr)
            short = CellInterrupted("the cell was interrupted on every rank (what each printed, and the cluster's "
                                    "check, are above)")
            short.outputs, short.cluster_status = self.state.last, status
            raise short from None
        finally:
            if progress is not None:
                progress.close()
        show_outputs(self.state.last)
        self.state.record_cell(cell, args.ranks)
        for text in summary_lines(cluster, asked[0] if asked else None):  # loss, norm, lr, tokens/s, MFU
            print(text)


def _near(name: str) -> str:
    near = difflib.get_close_matches(name, COMMANDS, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


ColossalMagics.colossal.__doc__ = help_text()  # what %colossal? shows: built from the one flags table


state = current  # the session of the running IPython (colab_kit.notebook.session.current)


def load_ipython_extension(ipython) -> None:
    if "ColossalMagics" in ipython.magics_manager.registry:
        return  # loaded twice: keep the existing state (and its cluster)
    ipython.register_magics(ColossalMagics(ipython, ColossalState()))


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext colab_kit`` (and the first half of ``%reload_ext colab_kit``): the magics go, with their
    state. A running cluster is stopped and the kept config dropped, and one line says so: they are not
    carried over to the reloaded extension, as reloading is for new code (the engines run the code they
    started with, and the state's class may have changed); ``%load_ext`` again starts from no cluster and no
    config. The views that ``%colossal memory`` / ``moe`` left watching stop refreshing."""
    magics = ipython.magics_manager.registry.pop("ColossalMagics", None)
    ipython.magics_manager.magics["line"].pop("colossal", None)
    ipython.magics_manager.magics["cell"].pop("colossal", None)
    if magics is None:
        return
    for view in (magics._memory_view, magics._moe_view):
        if view is not None:
            view.unwatch()
    magics._memory_view = magics._moe_view = None
    state, said = magics.state, []
    if state.cluster is not None and state.cluster.running:
        ranks = state.cluster.world_size
        try:
            state.cluster.stop()
            said.append(f"stopped the cluster of {ranks} ranks")
        except Exception as exc:  # noqa: BLE001 - unloading goes on: say what was left behind
            said.append(f"could not stop the cluster of {ranks} ranks ({type(exc).__name__}: {exc})")
        state.cluster = None
    if state.config is not None:
        said.append(f"dropped the kept config {state.config.describe()}")
    if said:
        print(f"colab_kit unloaded: {'; '.join(said)} (after %load_ext colab_kit: %colossal start -n N and "
              f"%colossal config again)")


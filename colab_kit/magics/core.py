"""``%colossal`` and ``%%colossal``: drive a ``ck.Cluster`` from a notebook.

    %load_ext colab_kit
    %colossal start -n 4              # 4 engines, torch.distributed up; shows rank, host, pid, device
    %colossal config dp=2 tp=2        # checked in the kernel first, then set on every rank (+ mesh)
    %colossal mesh --axis tp          # plotly figure of the device mesh (no cluster needed)
    %colossal schedule --pp 4 --microbatches 8 --schedule zb-h1   # planned grid, bubble (no cluster)
    %colossal timeline --var engine   # the last step of `engine` on every rank (measured)
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
when the other ranks wait for it in a collective (then ``%colossal restart``).
Bad input (unknown subcommand or flag, invalid config, world size mismatch, no
cluster) gives one clear paragraph, not a traceback. The magics act on one explicit
``ColossalState`` (``colab_kit.magics.state()`` returns the shell's).
"""
from __future__ import annotations

import difflib
import shlex
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from ..cluster import ClusterError
from ..config import ConfigError, ParallelConfig
from ..errors import RankError
from .flags import CELL_FLAGS, COMMANDS, help_text, parser
from .output import Progress, show_outputs
from .state import ColossalState

__all__ = ["ColossalState", "ColossalMagics", "state", "show_outputs", "load_ipython_extension",
           "unload_ipython_extension"]


def _show_error(shell, etype, value, tb, tb_offset=None):
    """Custom handler: the error's own message, without the kernel-side traceback."""
    text = str(value)
    if getattr(value, "shown", False):  # the magic already printed every rank's traceback
        text = text.split("\n--- traceback of rank")[0]
    stb = [f"{etype.__name__}: {text}"]
    shell._showtraceback(etype, value, stb)
    return stb


# ---------------------------------------------------------------- the magics
@magics_class
class ColossalMagics(Magics):
    """``%colossal`` / ``%%colossal``, bound to one explicit ``ColossalState``."""

    def __init__(self, shell, state: ColossalState):
        super().__init__(shell)
        self.state = state

    @line_cell_magic
    def colossal(self, line: str, cell: str | None = None):
        try:
            return self._line(line) if cell is None else self._cell(line, cell)
        except (ConfigError, ClusterError) as exc:  # bad input: one paragraph, no traceback
            raise UsageError(str(exc)) from None

    def _line(self, line: str):
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%colossal: cannot split {line!r}: {exc}") from None
        if not argv or argv[0] in ("help", "-h", "--help"):
            print(help_text())
            return None
        name, rest = argv[0], argv[1:]
        if name not in COMMANDS:
            near = difflib.get_close_matches(name, COMMANDS, n=1)
            raise UsageError(f"%colossal: unknown subcommand {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f". Subcommands: {', '.join(COMMANDS)}")
        flags, takes_words, _ = COMMANDS[name]
        p = parser(f"%colossal {name}", flags)
        if not takes_words:
            return getattr(self, f"_do_{name}")(p.parse_args(rest), [])
        args, words = p.parse_known_args(rest)
        try:
            return getattr(self, f"_do_{name}")(args, words)
        except ConfigError as exc:
            if not str(exc).startswith(("unknown config key", "cannot read", "flag ")):
                raise
            usage = p.format_usage().strip()[7:]  # a word it could not read: show what it takes
            raise UsageError(f"{exc}. Usage: {usage} [dp=2 tp=2 ... or --dp 2 --tp 2 ...]") from None

    def _do_start(self, args, words):
        t0 = time.perf_counter()
        cluster = self.state.start(args.n, args.engines, args.timeout)
        backend = cluster.ranks()[0]["backend"]
        print(f"started {cluster.world_size} ranks ({args.engines} engines, {backend}) "
              f"in {time.perf_counter() - t0:.1f} s")
        display(cluster.ranks())
        if self.state.config is not None and cluster.config is None:
            print(f"the kept config ({self.state.config.describe()}) does not fit {cluster.world_size} ranks: "
                  "set one with %colossal config")

    def _do_config(self, args, words):
        if not words:
            cfg = self.state.config
            print(f"config: {cfg.describe()}\n{cfg}" if cfg else "no config set: try %colossal config dp=4")
            return
        config = ParallelConfig.parse(words)  # validated in the kernel, before any engine
        print(self.state.apply_config(config))

    def _do_mesh(self, args, words):
        from ..viz.mesh import mesh_figure

        config = self.state.mesh_config(words)
        try:
            return mesh_figure(config, axis=args.axis)
        except ValueError as exc:
            raise UsageError(f"%colossal mesh: {exc}") from None

    def _do_schedule(self, args, words):
        from .pipeline_views import schedule_view

        text, fig = schedule_view(self.state.config, pp=args.pp, microbatches=args.microbatches,
                                  schedule=args.schedule, chunks=args.chunks)
        print(text)
        return fig

    def _do_timeline(self, args, words):
        from .pipeline_views import NoTimeline, timeline_view

        try:
            text, fig = timeline_view(self.state.require_cluster(), args.var)
        except NoTimeline as exc:
            raise UsageError(f"%colossal timeline: {exc}") from None
        print(text)
        return fig

    def _do_status(self, args, words):
        cluster = self.state.cluster
        print(cluster.status() if cluster is not None else "no cluster running")
        if cluster is not None and cluster.running:
            display(cluster.ranks())
        if self.state.config is not None and (cluster is None or not cluster.running):
            print(f"kept config: {self.state.config.describe()}")

    def _do_stop(self, args, words):
        self.state.stop()
        print("cluster stopped")

    def _do_restart(self, args, words):
        t0 = time.perf_counter()
        cluster = self.state.require_cluster().restart()
        print(f"restarted {cluster.world_size} ranks in {time.perf_counter() - t0:.1f} s"
              + (f" with config {cluster.config.describe()}" if cluster.config else ""))
        display(cluster.ranks())

    def _cell(self, line: str, cell: str):
        args = parser("%%colossal", CELL_FLAGS).parse_args(shlex.split(line))
        cluster = self.state.require_cluster()
        progress = Progress(cluster.world_size if args.ranks is None else len(args.ranks)) \
            if getattr(self.shell, "kernel", None) is not None else None  # a live line in notebooks only
        try:
            self.state.last = cluster.execute(cell, ranks=args.ranks, timeout=args.timeout, where="%%colossal",
                                              progress=progress)
        except RankError as err:
            self.state.last = getattr(err, "outputs", None)
            if self.state.last:
                show_outputs(self.state.last)
                err.shown = True
            raise err from None
        finally:
            if progress is not None:
                progress.close()
        show_outputs(self.state.last)


def state(shell=None) -> ColossalState:
    """The ColossalState of ``shell`` (default: the running IPython), once the extension is loaded."""
    from IPython import get_ipython

    shell = shell or get_ipython()
    magics = shell and shell.magics_manager.registry.get("ColossalMagics")
    if magics is None:
        raise RuntimeError("the colab_kit extension is not loaded: run %load_ext colab_kit")
    return magics.state


def load_ipython_extension(ipython) -> None:
    if "ColossalMagics" in ipython.magics_manager.registry:
        return  # loaded twice: keep the existing state (and its cluster)
    ipython.register_magics(ColossalMagics(ipython, ColossalState()))
    if not ipython.custom_exceptions:
        ipython.set_custom_exc((RankError, ClusterError, ConfigError), _show_error)


def unload_ipython_extension(ipython) -> None:
    magics = ipython.magics_manager.registry.pop("ColossalMagics", None)
    if magics is not None and magics.state.cluster is not None and magics.state.cluster.running:
        magics.state.cluster.stop()
    ipython.magics_manager.magics["line"].pop("colossal", None)
    ipython.magics_manager.magics["cell"].pop("colossal", None)
    if ipython.custom_exceptions == (RankError, ClusterError, ConfigError):
        ipython.set_custom_exc((), None)


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

import argparse
import difflib
import json
import shlex
import sys
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display, publish_display_data

from .cluster import Cluster, ClusterError, RankOutput
from .config import ConfigError, ParallelConfig
from .errors import RankError

__all__ = ["ColossalState", "ColossalMagics", "state", "show_outputs", "load_ipython_extension",
           "unload_ipython_extension"]


class ColossalState:
    """What the magics act on: at most one cluster, and the config chosen in the kernel.

    Usable without IPython: ``s = ColossalState(); s.start(4); s.apply_config(cfg)``.
    """

    def __init__(self):
        self.cluster: Cluster | None = None
        self.config: ParallelConfig | None = None   # also kept while no cluster runs (for mesh, next start)
        self.last: dict[int, RankOutput] | None = None  # outputs of the last %%colossal cell

    def require_cluster(self) -> Cluster:
        if self.cluster is None or not self.cluster.running:
            raise ClusterError("no cluster started: run %colossal start -n 4 first")
        return self.cluster

    def start(self, n: int | None = None, engines: str = "local", timeout: float | None = None) -> Cluster:
        if self.cluster is not None and self.cluster.running:
            raise ClusterError(f"a cluster of {self.cluster.world_size} ranks is already running: "
                               "%colossal stop it first, or %colossal restart it")
        cluster = Cluster(n, engines, timeout=timeout or 60).start()
        self.cluster = cluster
        if self.config is not None and self.config.world_size == cluster.world_size:
            cluster.set_config(self.config)
        return cluster

    def apply_config(self, config: ParallelConfig) -> str:
        """The one path a config takes to the ranks (``%colossal config`` and ConfigPicker's Apply)."""
        if self.cluster is None or not self.cluster.running:
            self.config = config
            return f"config {config.describe()} kept in the kernel; %colossal start will apply it"
        config.check_world_size(self.cluster.world_size)  # before any engine is touched
        self.cluster.set_config(config)
        self.config = config
        return f"config set on {self.cluster.world_size} ranks: {config.describe()}"

    def mesh_config(self, words: list[str]) -> ParallelConfig:
        if words:
            return ParallelConfig.parse(words)
        if self.config is not None:
            return self.config
        if self.cluster is not None and self.cluster.running:
            return ParallelConfig(dp=self.cluster.world_size)
        raise ConfigError("no config to draw: set one with %colossal config dp=2 tp=2, "
                          "or give it inline: %colossal mesh dp=2 tp=2")

    def stop(self) -> None:
        self.require_cluster().stop()
        self.cluster = None


# ---------------------------------------------------------------- flags, declared once
def _rank_list(text: str) -> list[int]:
    try:
        return [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks like 0,2, got {text!r}") from None


_FLAGS = {
    "n": (("-n",), dict(type=int, default=None, metavar="N", help="engines (ranks); default: one per GPU, else 4")),
    "engines": (("--engines",), dict(default="local", help="ipyparallel launcher: local, mpi, slurm, ssh, ...")),
    "timeout": (("--timeout",), dict(type=float, default=None, metavar="S", help="seconds before giving up")),
    "axis": (("--axis",), dict(default="tp", help="colour the ranks by their group on this axis")),
    "ranks": (("--ranks",), dict(type=_rank_list, default=None, metavar="0,2", help="only these ranks")),
    "pp": (("--pp",), dict(type=int, default=None, metavar="P", help="pipeline ranks")),
    "microbatches": (("-m", "--microbatches"), dict(type=int, default=None, metavar="M", help="microbatches per step")),
    "schedule": (("--schedule",), dict(default=None, metavar="S", help="gpipe, 1f1b, interleaved or zb-h1")),
    "chunks": (("--chunks",), dict(type=int, default=None, metavar="V", help="model chunks per rank (interleaved)")),
    "var": (("--var",), dict(default="engine", metavar="NAME", help="the engine's variable on the ranks")),
}
_COMMANDS = {  # name: (flags, takes config words, help)
    "start": (("n", "engines", "timeout"), False, "start engines and torch.distributed; show the ranks"),
    "config": ((), True, "check a config (dp=2 tp=2 or --dp 2 --tp 2) and set it on every rank"),
    "mesh": (("axis",), True, "draw the device mesh of the config (or of config words given here)"),
    "schedule": (("pp", "microbatches", "schedule", "chunks"), False,
                 "plan a pipeline schedule (no cluster needed): grid, bubble, peak activations"),
    "timeline": (("var",), False, "the last training step of every rank: compute, communication, idle"),
    "status": ((), False, "show the cluster, its ranks and config"),
    "stop": ((), False, "stop the cluster"),
    "restart": ((), False, "fresh engines with the same config (after a failure)"),
    "help": ((), False, "this help"),
}
_CELL_FLAGS = ("ranks", "timeout")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and sys.exit: a clear UsageError instead
        raise UsageError(f"{self.prog}: {message}. Usage: {self.format_usage().strip()[7:]}")


def _parser(prog: str, flags) -> _Parser:
    p = _Parser(prog=prog, add_help=False, allow_abbrev=False)
    for name in flags:
        names, kwargs = _FLAGS[name]
        p.add_argument(*names, dest=name, **kwargs)
    return p


def _help() -> str:
    lines = ["%colossal SUBCOMMAND [flags]:"]
    for name, (flags, words, text) in _COMMANDS.items():
        usage = _parser(f"%colossal {name}", flags).format_usage().strip()[7:] + (" [dp=.. tp=..]" if words else "")
        lines.append(f"  {usage:<58} {text}")
    lines.append("%%colossal [--ranks 0,2] [--timeout S]: run the cell on every rank (rank, config, mesh predefined)")
    return "\n".join(lines)


# ---------------------------------------------------------------- showing rank outputs
def show_outputs(outputs: dict[int, RankOutput]) -> None:
    """Print outputs grouped per rank; ranks with identical output share one group."""
    groups: dict[str, list[RankOutput]] = {}
    for out in outputs.values():
        key = json.dumps([out.stdout, out.stderr, out.result, out.status, out.error, out.displays],
                         sort_keys=True, default=str)
        groups.setdefault(key, []).append(out)
    for outs in groups.values():
        o, ranks = outs[0], [x.rank for x in outs]
        if not (o.stdout or o.stderr or o.result is not None or o.displays or o.status != "ok"):
            continue
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        print(f"[{name}]" + {"ok": "", "error": " FAILED", "stuck": " still running (given up on)"}[o.status])
        if o.stdout:
            print(o.stdout, end="" if o.stdout.endswith("\n") else "\n")
        if o.stderr:
            print(o.stderr, end="" if o.stderr.endswith("\n") else "\n", file=sys.stderr)
        for d in o.displays:
            publish_display_data(d["data"], d["metadata"])
        if o.result is not None:
            print(f"Out[{name}]: {o.result}")
        if o.error:
            print(o.error.rstrip(), file=sys.stderr)
    sys.stdout.flush()


class _Line:
    """A one-line display (HTML in a notebook, plain text elsewhere)."""

    def __init__(self, text: str):
        self.text = text

    def _repr_html_(self) -> str:
        escaped = self.text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return f"<code>{escaped}</code>" if self.text else ""

    def __repr__(self) -> str:
        return self.text


class _Progress:
    """A live line saying that a long cell still runs, with the latest line a rank printed;
    emptied when the cell ends (its grouped output follows)::

        running on 4 ranks for 7 s; rank 0: step 10  loss 3.0004
    """

    def __init__(self, n: int, after: float = 2.0):
        self.n, self.after, self.handle = n, after, None

    def __call__(self, seconds: float, stdout: dict[int, str]) -> None:
        if seconds < self.after:
            return
        said = [(r, out.rstrip().splitlines()[-1]) for r, out in stdout.items() if out.strip()]
        line = _Line(f"running on {self.n} ranks for {seconds:.0f} s"
                     + (f"; rank {said[0][0]}: {said[0][1]}" if said else ""))
        if self.handle is None:
            self.handle = display(line, display_id=True)
        else:
            self.handle.update(line)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update(_Line(""))


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
            print(_help())
            return None
        name, rest = argv[0], argv[1:]
        if name not in _COMMANDS:
            near = difflib.get_close_matches(name, _COMMANDS, n=1)
            raise UsageError(f"%colossal: unknown subcommand {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f". Subcommands: {', '.join(_COMMANDS)}")
        flags, takes_words, _ = _COMMANDS[name]
        parser = _parser(f"%colossal {name}", flags)
        if not takes_words:
            return getattr(self, f"_do_{name}")(parser.parse_args(rest), [])
        args, words = parser.parse_known_args(rest)
        try:
            return getattr(self, f"_do_{name}")(args, words)
        except ConfigError as exc:
            if not str(exc).startswith(("unknown config key", "cannot read", "flag ")):
                raise
            usage = parser.format_usage().strip()[7:]  # a word it could not read: show what it takes
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
        from .viz.mesh import mesh_figure

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
        args = _parser("%%colossal", _CELL_FLAGS).parse_args(shlex.split(line))
        cluster = self.state.require_cluster()
        progress = _Progress(cluster.world_size if args.ranks is None else len(args.ranks)) \
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

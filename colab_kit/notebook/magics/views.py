"""The ``%colossal`` subcommands that draw: ``mesh``, ``schedule``, ``timeline``, ``profile``, ``memory``, ``moe`` and
``plan``, as ``ViewCommands``, the mixin ``ColossalMagics`` (``core.py``) inherits them from.

Each ``_do_<name>(args, words)`` gets the subcommand's parsed flags and its ``key=value`` words and returns what the
cell shows: a plotly figure, or a widget (``MemoryView``, ``MoEView``, ``PlannerView``) where a notebook renders
widgets, its text table and figure elsewhere. Bad input is a ``UsageError`` written in the subcommand's own flags.
Worked example, in a kernel with no cluster::

    %colossal mesh --axis tp dp=2 tp=2     # _do_mesh: the 4-rank mesh, tp groups [0, 1] and [2, 3] coloured
    %colossal schedule --pp 4 --microbatches 8 --schedule 1f1b   # _do_schedule: the planned grid and its bubble
    %colossal mesh --axis pp dp=2 tp=2     # UsageError: unknown axis 'pp' ... this mesh has axes dp, tp

The plotly and widget modules are imported when a subcommand draws (``LOCAL_IMPORTS`` in tests/unit/test_layout.py):
loading the extension imports neither.
"""
from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from ...config import Axis, ConfigError, ParallelConfig
from ...mesh import MeshLayout
from ...models import GPTConfig
from ...planner import plan
from .flags import COMMANDS
from .pipeline_views import (NoTimeline, memory_timeline_view, no_engine, profile_view, schedule_view,
                             timeline_view)

if TYPE_CHECKING:
    from ..session import ColossalState
    from ..widgets.memory_view import MemoryView
    from ..widgets.moe_view import MoEView

__all__ = ["ViewCommands", "as_flags"]


class ViewCommands:
    """The drawing subcommands of ``%colossal`` (see the module docstring); ``ColossalMagics`` supplies ``state``,
    ``shell``, ``_notebook`` and the views ``%colossal memory`` and ``moe`` left watching."""

    state: ColossalState
    shell: Any
    _memory_view: MemoryView | None
    _moe_view: MoEView | None

    @property
    def _notebook(self) -> bool:
        raise NotImplementedError  # ColossalMagics: whether a kernel shows live lines and widgets

    def _do_mesh(self, args, words):
        """The mesh coloured by ``--axis`` (read in any case); an axis this mesh lacks, or ``--axis experts``
        on a config that does not split the experts, is a ``UsageError`` phrased in the magic's flags."""
        from ...viz.mesh import expert_mesh_figure, mesh_figure

        config = self.state.mesh_config(words)
        dense = Axis.TP if config.tp > 1 else Axis.DP
        axes = MeshLayout(config).axes
        if args.axis not in (*axes, "experts"):
            near = difflib.get_close_matches(args.axis, (*axes, "experts"), n=1)
            hint = f"did you mean --axis {near[0]}? " if near else ""
            raise UsageError(f"%colossal mesh: unknown axis {args.axis!r} for tp_mode={config.tp_mode!r}: {hint}"
                             f"this mesh has axes {', '.join(axes)} (and --axis experts draws the dense, ep and "
                             f"edp groups side by side)")
        if args.axis == "experts" and config.ep <= 1:
            fold = config.dp * config.sp
            ep = next((k for k in range(2, fold + 1) if fold % k == 0), None)
            defaults = ParallelConfig().to_dict()
            inline = " ".join(f"{k}={v}" for k, v in config.to_dict().items() if defaults.get(k) != v and k != Axis.EP)
            fix = (f"or split them with ep above 1 (a divisor of dp x sp = {fold}): %colossal mesh --axis experts "
                   f"{inline} ep={ep}" if ep else
                   "and its dp x sp is 1, nothing to split them over: give dp above 1 and ep, e.g. %colossal "
                   "mesh --axis experts dp=4 ep=2")
            raise UsageError(f"%colossal mesh --axis experts: {config.describe()} does not split the experts (ep=1), "
                             f"so it has no ep or edp groups: draw it with %colossal mesh --axis {dense}, {fix}")
        try:
            if args.axis == "experts":
                return expert_mesh_figure(config, dense=dense)
            return mesh_figure(config, axis=args.axis)
        except ValueError as exc:
            raise UsageError(f"%colossal mesh: {exc}") from None

    def _do_schedule(self, args, words):
        """The planned schedule; a shape it cannot take is a ``UsageError`` whose advice is in this magic's flags
        (``try --chunks 2``, not ``try chunks=2``: the rule comes from ``ParallelConfig``)."""
        try:
            text, fig = schedule_view(self.state.config, pp=args.pp, microbatches=args.microbatches,
                                      schedule=args.schedule, chunks=args.chunks)
        except ConfigError as exc:
            raise UsageError(f"%colossal schedule: {as_flags(str(exc), COMMANDS['schedule'][0])}") from None
        print(text)
        return fig

    def _do_timeline(self, args, words):  # timeline_view says what --var holds where it holds no engine
        return _text_then_figure("timeline", lambda: timeline_view(self.state.require_cluster(), args.var))

    def _do_profile(self, args, words):
        return _text_then_figure("profile", lambda: profile_view(self.state.require_cluster(), args.var, args.data))

    def _do_memory(self, args, words):
        """A ``MemoryView`` that watches (refreshed after each ``%%colossal`` cell) where widgets render;
        elsewhere its text table, and the figure as the result."""
        from ..widgets.memory_view import MemoryView, NoMemory

        cluster = self.state.require_cluster()
        if args.timeline:
            return _text_then_figure("memory --timeline", lambda: memory_timeline_view(cluster, args.var, args.data))
        try:
            view = MemoryView(self.state, args.var, by=args.by)
        except NoMemory as exc:
            raise UsageError(f"%colossal memory: {self._no_engine(cluster, args.var, exc)}") from None
        old, self._memory_view = self._memory_view, None
        if old is not None:
            old.unwatch()  # the view shown before stops refreshing: one watcher per %colossal memory
        if self._notebook and _has_widgets():
            self._memory_view = view.watch(self.shell)
            return view
        print(repr(view))
        return view.figure()

    def _do_moe(self, args, words):
        """A ``MoEView`` that watches where widgets render; elsewhere its text, and the load figure as the result."""
        from ..widgets.moe_view import MoEView, NoMoE

        cluster = self.state.require_cluster()
        try:
            view = MoEView(self.state, args.var, layer=args.layer)
        except NoMoE as exc:
            raise UsageError(f"%colossal moe: {self._no_engine(cluster, args.var, exc)}") from None
        except ConfigError as exc:
            raise UsageError(f"%colossal moe: {exc}") from None
        old, self._moe_view = self._moe_view, None
        if old is not None:
            old.unwatch()
        if self._notebook and _has_widgets():
            self._moe_view = view.watch(self.shell)
            return view
        print(repr(view))
        return view.load_figure()

    def _do_plan(self, args, words):
        """``ck.plan`` for the model in ``--model``: a ``PlannerView`` where widgets render (Apply sets the
        chosen config as ``%colossal config`` does); elsewhere its text table, and the scatter as the result."""
        model_cfg = self._model_config(args.model)
        if args.world is not None:
            ranks = args.world
        elif self.state.cluster is not None and self.state.cluster.running:
            ranks = self.state.cluster.world_size
        else:
            raise UsageError("%colossal plan: no cluster to take the number of ranks from: "
                             "give --ranks N, or run %colossal start -n 4 first")
        from ..widgets.planner_view import PlannerView

        if args.memory is not None and args.memory < 1024:  # given with its unit here: ck.plan's "is in bytes" misleads
            raise UsageError(f"%colossal plan: --memory comes to {args.memory} bytes, less than a KiB, and no device "
                             "holds a training step in that: did you mean GiB? e.g. --memory 16GiB")
        try:
            cands = plan(model_cfg, ranks, args.batch, memory_per_rank=args.memory)
            view = PlannerView(cands, self.state, memory_per_rank=args.memory, top=args.top)
        except ValueError as exc:  # ConfigError included: the rule the model, batch or ranks break
            raise UsageError(f"%colossal plan: {exc}") from None
        if self._notebook and _has_widgets():
            return view
        print(repr(view))
        return view.figure()

    @staticmethod
    def _no_engine(cluster, var: str, exc: Exception) -> str:
        """``exc``'s message, or where it says the ranks have no engine in ``var`` (``NoMemory``, ``NoMoE``), what
        ``var`` holds there instead and which variables do hold engines (``pipeline_views.no_engine``)."""
        if "have no engine in a variable" not in str(exc):
            return str(exc)
        try:
            return no_engine(cluster, var)
        except Exception:  # noqa: BLE001 - asking the ranks again failed: the view's own message then
            return str(exc)

    def _model_config(self, var: str):
        """The GPTConfig in the kernel variable ``var`` (or the ``.cfg`` of a GPT there)."""
        assert self.shell is not None  # a magic runs in a shell
        if var not in self.shell.user_ns:
            raise UsageError(f"%colossal plan: no variable {var!r} in the kernel: define the model's config first, "
                             f"e.g. {var} = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4)")
        value = self.shell.user_ns[var]
        value = value if isinstance(value, GPTConfig) else getattr(value, "cfg", value)
        if not isinstance(value, GPTConfig):
            raise UsageError(f"%colossal plan: {var!r} is a {type(value).__name__}, not a GPTConfig or a GPT: "
                             "--model names a variable holding the model's GPTConfig")
        return value


def _text_then_figure(what: str, view):
    """Print the text of ``view()`` (a ``(text, figure)`` of ``pipeline_views``) and return its figure; a
    ``NoTimeline`` it raises is a ``UsageError`` of ``%colossal <what>``."""
    try:
        text, fig = view()
    except NoTimeline as exc:
        raise UsageError(f"%colossal {what}: {exc}") from None
    print(text)
    return fig


def as_flags(message: str, flags) -> str:
    """``message`` (a ``ConfigError``'s: ``rule: advice``) with the advice's ``key=value`` words for keys that are
    ``flags`` of the magic written as those flags: ``set chunks=1 or schedule='interleaved'`` -> ``set --chunks 1
    or --schedule interleaved``. The rule before the last ``: `` keeps its words (it says what the values are)."""
    rule, sep, advice = message.rpartition(": ")
    if not sep:
        return message
    names = "|".join(sorted(flags, key=len, reverse=True))

    def flag(m: re.Match) -> str:
        value = m.group(2) if m.group(2) is not None else m.group(3)
        return f"--{m.group(1)} {value}"
    return rule + sep + re.sub(rf"\b({names})=(?:'([^']*)'|([\w.-]+))", flag, advice)


def _has_widgets() -> bool:
    import importlib.util

    return importlib.util.find_spec("ipywidgets") is not None

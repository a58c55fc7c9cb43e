"""``ConfigPicker``: choose the parallel degrees with widgets, see the mesh, apply to the cluster.

    picker = ck.widgets.ConfigPicker()      # uses the %colossal cluster when there is one
    picker                                  # widgets in a notebook, a text summary elsewhere

Every change is validated at once with ``ParallelConfig`` and the world size,
and the status line says whether it fits (or shows the ConfigError's message)::

    picker.set(dp=2, tp=2)   # on a 4-rank cluster -> "ok: dp=2 x tp=2 (1d) = 4 ranks fits the 4 ranks"
    picker.set(tp=3)         # -> "not valid: this config needs dp*pp*sp*tp = 2*1*1*3 = 6 ranks, but there are 4: ..."
    picker.set(dp=4, tp=1, ep=3)  # -> "not valid: ep=3 splits the experts over ranks that already split the
                             #     batch (dp x sp = 4 x 1 = 4), so it must divide dp x sp: try ep=..."
    picker.ep_choices()      # [1, 2, 4]: the divisors of dp x sp, shown beside the ep box
    picker.set(dp=1, pp=2, zero=3)  # -> "valid, not runnable yet: this version of the engine does not run
                                    #     ZeRO stage 3 with pipeline parallelism yet (...)": ck.boost would refuse it
    picker.apply()           # the same path as %colossal config: config and mesh set on every rank

The logic (``set``, ``status``, ``config``, ``figure``, ``apply``) needs no browser;
ipywidgets is imported only when the widget is shown. The Apply button shows that it is
applying (disabled, "Applying…", a status line) while the ranks build the mesh, then the
result or the error; in a kernel that call runs in a worker thread, so the kernel stays free.
"""
from __future__ import annotations

from typing import Any

from ...config import Axis, RECOMPUTES, SCHEDULES, SP_MODES, TP_MODES, ConfigError, ParallelConfig
from ..session import find
from .display import KernelDisplay, html, then
from .figure_view import figure_view, redraw
from ...engine.core import unsupported
from ...errors import RankError
from ...mesh import MeshLayout
from ...viz.mesh import expert_mesh_figure, mesh_figure
from ..cluster import ClusterError

__all__ = ["ConfigPicker", "FIELDS", "mesh_summary"]

FIELDS = ("dp", "tp", "pp", "sp", "ep", "tp_mode", "tp_depth", "sp_mode", "schedule", "microbatches", "chunks", "zero",
          "recompute")
_CHOICES = {"tp_mode": TP_MODES, "sp_mode": SP_MODES, "schedule": SCHEDULES, "zero": (0, 1, 2, 3),
            "recompute": RECOMPUTES}


class ConfigPicker(KernelDisplay):
    """Widgets for dp, tp, pp, sp, ep, tp_mode, tp_depth, sp_mode, schedule, microbatches, chunks, zero, recompute.

    cluster: where Apply sends the config; None means the %colossal cluster (if any).
    world_size: the size the choice must fit; None means the cluster's size (or no check).
    """

    def __init__(self, cluster=None, world_size: int | None = None, *, config: ParallelConfig | None = None,
                 state=None):
        self.cluster = cluster
        self.state = state if state is not None else (find() if cluster is None else None)
        self._world_size = world_size
        start = config or (self.state.config if self.state is not None else None) \
            or (self.target.config if self.target is not None else None)
        if start is None:
            start = ParallelConfig(dp=self.world_size or 1)
        self.values = {f: getattr(start, f) for f in FIELDS}
        self.config: ParallelConfig | None = None   # the current choice when valid
        self.error: str | None = None                # the rule it breaks when not
        self.unsupported: str | None = None          # why ck.boost refuses it although it is valid
        self.message = ""                            # result of the last Apply
        self._ui: dict[str, Any] | None = None  # the widgets, once built
        self._validate()

    # ------------------------------------------------------------ logic (no widgets)
    @property
    def target(self):
        """The cluster Apply would use, or None."""
        if self.cluster is not None:
            return self.cluster
        return self.state.cluster if self.state is not None else None

    @property
    def world_size(self) -> int | None:
        if self._world_size is not None:
            return self._world_size
        target = self.target
        return target.world_size if target is not None and target.running else None

    def set(self, **changes) -> str:
        """Change some fields (as a widget would), validate, redraw; return the status text."""
        for key, value in changes.items():
            if key not in FIELDS:
                raise ConfigError(f"ConfigPicker has no field {key!r}: fields are {', '.join(FIELDS)}")
            self.values[key] = value
        self._validate()
        if self._ui is not None:
            self._sync_ui(changes)
        return self.status()

    def _validate(self) -> None:
        try:
            cfg = ParallelConfig.from_dict(self.values)
            if self.world_size is not None:
                cfg.check_world_size(self.world_size)
        except ConfigError as exc:
            self.config, self.error, self.unsupported = None, str(exc), None
        else:
            self.config, self.error, self.unsupported = cfg, None, unsupported(cfg)

    def status(self) -> str:
        """'ok: ...' when the choice is valid, fits and ``ck.boost`` runs it; 'valid, not runnable yet:
        <why boost refuses it>'; else 'not valid: <the ConfigError message>'."""
        if self.error is not None:
            return f"not valid: {self.error}"
        if self.unsupported is not None:
            return f"valid, not runnable yet: {self.unsupported}"
        assert self.config is not None  # _validate sets a config or an error
        n = self.world_size
        fits = f" fits the {n} ranks" if n is not None else " (no cluster: nothing to check the world size against)"
        return f"ok: {self.config.describe()}{fits}"

    def ep_choices(self) -> list[int]:
        """The ep degrees the current dp and sp allow: the divisors of dp x sp (ep folds over those ranks).

        >>> ConfigPicker(world_size=8, config=ParallelConfig(dp=4, tp=2)).ep_choices()
        [1, 2, 4]
        """
        fold = max(1, int(self.values["dp"] or 1) * int(self.values["sp"] or 1))
        return [d for d in range(1, fold + 1) if fold % d == 0]

    def figure(self):
        """The mesh figure of the current choice (an empty figure naming the problem when invalid); with
        ep > 1 the dense groups beside the expert groups (``viz.mesh.expert_mesh_figure``)."""
        import plotly.graph_objects as go


        if self.config is None:
            fig = go.Figure()
            fig.update_layout(title="no valid config", xaxis=dict(visible=False), yaxis=dict(visible=False),
                              height=200, plot_bgcolor="white")
            return fig
        if self.config.ep > 1:
            return expert_mesh_figure(self.config, dense=Axis.TP if self.config.tp > 1 else Axis.DP)
        return mesh_figure(self.config, axis=Axis.TP if self.config.tp > 1 else Axis.DP)

    def apply(self) -> str:
        """Send the current choice to the cluster, by the same path as ``%colossal config``."""
        self.message = self._apply()
        if self._ui is not None:
            self._ui["message"].value = self.message
        return self.message

    def _apply(self) -> str:
        """What ``apply`` does, without touching the widgets (so a worker thread can run it)."""
        if self.config is None:
            return f"not applied: {self.error}"
        if self.target is None or not self.target.running:
            return "not applied: no cluster running (start one with %colossal start -n 4)"
        try:
            if self.cluster is None and self.state is not None:
                return self.state.apply_config(self.config)
            self.target.set_config(self.config)
            return f"config set on {self.target.world_size} ranks: {self.config.describe()}"
        except (ConfigError, ClusterError, RankError) as exc:
            return f"not applied: {str(exc).splitlines()[0]}"

    def _click_apply(self):
        """The Apply button: show that it is applying, set the config (off the kernel's loop when one runs),
        then show the result or the error. Returns the task, or None when it ran at once."""
        ui = self._ui
        assert ui is not None  # a click: the widgets exist
        ui["apply"].disabled, ui["apply"].description = True, "Applying…"
        ui["message"].value = (f"applying {self.config.describe()}: building the mesh on every rank…"
                               if self.config else "applying…")
        return then(self._attempt, self._applied)

    def _attempt(self) -> str:
        try:
            return self._apply()
        except Exception as exc:  # noqa: BLE001 - a button has nowhere else to report
            return f"not applied: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"

    def _applied(self, message: str) -> None:
        self.message = message
        ui = self._ui
        assert ui is not None  # the end of a click: the widgets exist
        ui["message"].value = message
        ui["apply"].disabled, ui["apply"].description = False, "Apply"

    # ------------------------------------------------------------ widgets (lazy)
    def widget(self):
        """The ipywidgets form (built once)."""
        if self._ui is None:
            self._ui = self._build()
        return self._ui["box"]

    def _build(self) -> dict:
        import ipywidgets as w

        ui = {}
        for f in FIELDS:
            if f in _CHOICES:
                ui[f] = w.Dropdown(options=list(_CHOICES[f]), value=self.values[f], description=f)
            else:
                ui[f] = w.BoundedIntText(value=self.values[f], min=1, max=1024, description=f)
            ui[f].layout.width = "180px"
            ui[f].observe(lambda change, f=f: self.set(**{f: change["new"]}), names="value")
        ui["status"], ui["ep_hint"] = w.HTML(), w.HTML()
        ui["message"] = w.Label(value=self.message)
        ui["apply"] = w.Button(description="Apply", button_style="primary", tooltip="set this config on every rank")
        ui["apply"].on_click(lambda _: self._click_apply())
        ui["fig"] = figure_view(self.figure())
        degrees = w.HBox([ui[f] for f in ("dp", "tp", "pp", "sp", "ep")] + [ui["ep_hint"]])
        modes = w.HBox([ui[f] for f in ("tp_mode", "tp_depth", "sp_mode")])
        sched = w.HBox([ui[f] for f in ("schedule", "microbatches", "chunks", "zero", "recompute")])
        ui["box"] = w.VBox([degrees, modes, sched, ui["status"], w.HBox([ui["apply"], ui["message"]]), ui["fig"]])
        self._ui = ui
        self._sync_ui({})
        return ui

    def _sync_ui(self, changes: dict) -> None:
        ui = self._ui
        assert ui is not None  # called once they are built
        for key, value in changes.items():
            if ui[key].value != value:
                ui[key].value = value  # observers call set() again with the same value: harmless
        colour = "#b00020" if self.error else "#b36b00" if self.unsupported else "green"
        ui["status"].value = f"<span style='color:{colour}'>{html(self.status())}</span>"
        ui["ep_hint"].value = html(f"ep (experts split) divides dp x sp: {', '.join(map(str, self.ep_choices()))}")
        redraw(ui["fig"], self.figure())

    def __repr__(self) -> str:
        fields = " ".join(f"{k}={v}" for k, v in self.values.items())
        text = f"ConfigPicker({fields})\n{self.status()}"
        return text if self.config is None else f"{text}\n{mesh_summary(self.config)}"


def mesh_summary(config: ParallelConfig, most: int = 4) -> str:
    """The groups of every axis with more than one rank, the text form of the mesh figure.

    >>> mesh_summary(ParallelConfig(dp=2, tp=2))
    'mesh: dp groups [0, 2] [1, 3]; tp groups [0, 1] [2, 3]'
    """
    lay = MeshLayout(config)
    parts = []
    for axis in lay.axes:
        if lay.size(axis) > 1:
            groups = lay.groups(axis)
            more = f" ... ({len(groups)} groups)" if len(groups) > most else ""
            parts.append(f"{axis} groups " + " ".join(str(g) for g in groups[:most]) + more)
    return "mesh: " + ("; ".join(parts) or "one rank")


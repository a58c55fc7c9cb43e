"""``MoEView``: how the experts of a mixture-of-experts model were loaded, and what the all-to-all moved.

    view = ck.widgets.MoEView()        # the %colossal cluster; the engine is `engine` on every rank
    view                               # layer picker, Refresh, the load heatmap and the traffic heatmap
    view.watch()                       # from now on refreshed after every %%colossal cell that ran
    %colossal moe --layer 1            # the same view, watching (it replaces the one shown before)

``refresh()`` reads, in one ``cluster.run``, every rank's ``engine.config`` and the ``"moe"`` part of its
``engine.records`` (``colab_kit.expert.records``), then redraws two figures of ``colab_kit.viz.moe``:
``expert_load_figure`` (experts x steps, load over the mean; the counts are the whole batch's, so one rank's
records suffice per layer, and with pp each layer is read from a rank of its stage) and, with ``ep > 1``,
``moe_traffic_figure`` of the last step (``expert.records.traffic``: rank i's bytes to rank j). Outside a
kernel the view is this text (the MoE GPT of tests/cluster/test_moe_view.py, dp=4 ep=4, after 3 steps)::

    MoEView('engine' on 4 ranks, steps 1-3; recorded)
      layer 0  experts 4  step 3: loads 71 60 61 64  busiest 1.11x the mean  dropped 7
      layer 1  experts 4  step 3: loads 52 58 57 89  busiest 1.39x the mean  dropped 25
      dispatch bytes of step 3, all MoE layers (row: from rank, column: to rank)
                  0        1        2        3
        0      4,224    3,584    4,224    4,352
      ...

Refreshing follows ``MemoryView`` (``watching.RankView``: a ``post_run_cell`` callback, skipped after a
failed cell or with the cluster down; the Refresh button reads the ranks off the kernel's loop; an error shows
in the widget, never in the cell).
"""
from __future__ import annotations

from typing import Any

from .display import KernelDisplay, html
from .figure_view import figure_view, redraw
from .watching import RankView
from ...config import ConfigError
from ...errors import RankError
from ...mesh import MeshLayout
from ...observe.moe import busiest, loads_by_layer
from ...expert.records import traffic
from ...viz.moe import expert_load_figure, moe_traffic_figure
from colab_kit.notebook.cluster.remote import namespace

__all__ = ["MoEView", "NoMoE"]


class NoMoE(LookupError):
    """No cluster, no engine in that variable, or an engine without MoE records."""


def _rank_moe(var: str, known: dict | None = None):
    """On a rank: its engine's config and the MoE part of its records, or None without an engine. ``known``
    (engine token -> the last step the view holds of it): only the records after that step when this rank's
    engine is one of those (``"since"`` says so), else all of them. The token is a random id the first read
    leaves on the engine, so a new engine in the same variable is read whole."""
    import uuid

    eng = namespace().get(var)
    if eng is None or not hasattr(eng, "records") or not hasattr(eng, "config"):
        return None
    token = vars(eng).setdefault("_moe_view_token", uuid.uuid4().hex)
    since = (known or {}).get(token)
    return {"config": eng.config, "engine": token, "since": since,
            "records": [{"step": r["step"], "moe": r["moe"]} for r in eng.records
                        if r.get("moe") and (since is None or r["step"] > since)]}


class MoEView(RankView, KernelDisplay):
    """The expert load per step and the last step's dispatch traffic of the engine in ``var`` on every rank.

    cluster: a ``Cluster``, a ``ColossalState`` (its cluster looked up at each refresh), or None: the
        ``%colossal`` state's. layer: the MoE layer the load figure shows (None: every layer stacked).
    """

    missing = NoMoE

    def __init__(self, cluster=None, var: str = "engine", *, layer: int | None = None):
        self._source, self.var = cluster, var
        self.layer: int | None = None
        self.config = None
        self.loads: dict[int, dict] = {}
        self.last: dict[int, list[dict]] = {}   # rank -> its "moe" list of the last common step
        self.step: int | None = None
        self.refreshes, self.busy = 0, False
        self.error: str | None = None
        self._ui: dict[str, Any] | None = None
        self._held: list[dict] = []  # per rank: its engine's id, its MoE records, the last step among them
        self._init_watch()
        self.refresh()
        if layer is not None:
            self.set_layer(layer)  # a layer without records: ConfigError naming the recorded ones

    def set_layer(self, layer: int | None) -> MoEView:
        if layer is not None and layer not in self.loads:
            raise ConfigError(f"layer={layer} has no MoE records: the recorded MoE layers are "
                              f"{', '.join(map(str, self.loads))} (or None for all of them)")
        self.layer = layer
        self._redraw()
        return self

    def load_figure(self):
        return expert_load_figure(self.loads, self.layer)

    def traffic(self) -> list[list[int]] | None:
        """The last step's rank x rank dispatch bytes (``expert.records.traffic``), None without ep."""
        if self.config is None or getattr(self.config, "ep", 1) <= 1 or not self.last:
            return None
        return traffic(self.last, MeshLayout(self.config), self.layer)

    def traffic_figure(self):
        matrix = self.traffic()
        return None if matrix is None else moe_traffic_figure(matrix, step=self.step, layer=self.layer)

    def table(self) -> str:
        steps = sorted({s for row in self.loads.values() for s in row["steps"]})
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        lines = [f"MoEView({self.var!r} on {len(self.last)} ranks, {span}; recorded)"]
        for n, row in self.loads.items():
            c = row["counts"][-1]
            lines.append(f"  layer {n}  experts {len(c)}  step {row['steps'][-1]}: loads {' '.join(map(str, c))}  "
                         f"busiest {busiest(c):.2f}x the mean  dropped {row['dropped'][-1]}")
        matrix = self.traffic()
        if matrix is None:
            lines.append("  no dispatch traffic: the experts are not split (ep=1)")
        else:
            which = f"layer {self.layer}" if self.layer is not None else "all MoE layers"
            lines.append(f"  dispatch bytes of step {self.step}, {which} (row: from rank, column: to rank)")
            lines.append("        " + "".join(f"{j:>9}" for j in range(len(matrix))))
            lines += [f"    {i:<4}" + "".join(f"{b:>9,}" for b in row) for i, row in enumerate(matrix)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table() + (f"\n  last refresh failed: {self.error}" if self.error else "")

    # ------------------------------------------------------------ the ranks
    def _gather(self) -> list:
        """Every rank's config and MoE records: the steps after those held already where its engine is the
        same one (a long run is not read again whole at each refresh), all of them for a new engine."""
        known = {h["engine"]: h["last"] for h in self._held}
        try:
            got = self.cluster.run(_rank_moe, self.var, known, progress=None)
        except RankError as exc:
            raise NoMoE(f"could not read the MoE records on the ranks: {str(exc).splitlines()[0]}") from None
        missing = [r for r, g in enumerate(got) if g is None]
        if missing:
            raise NoMoE(f"ranks {missing} have no engine in a variable {self.var!r}: build one on every rank, or "
                        f"name its variable with --var NAME / MoEView(var=NAME)")
        held = {h["engine"]: h["records"] for h in self._held}  # an engine read before: new records after these
        got = [{**g, "records": held[g["engine"]] + g["records"]} if g["since"] is not None else g for g in got]
        if not any(g["records"] for g in got):
            raise NoMoE(f"{self.var!r} has no MoE records: its model has no MoE layer (GPTConfig(n_experts=4, ...)) "
                        f"or it has not trained a step yet ({self.var}.train_step(batch) in a %%colossal cell)")
        return got

    def _take(self, got: list) -> None:
        self._held = [{"engine": g["engine"], "records": g["records"],
                       "last": max((r["step"] for r in g["records"]), default=0)} for g in got]
        loads: dict[int, dict] = {}
        for g in got:  # with pp each rank records its stage's layers: the first rank with a layer gives it
            for n, row in loads_by_layer(g["records"]).items():
                loads.setdefault(n, row)
        # the last step every rank with MoE layers recorded (with pp, a stage without one records none)
        common = set.intersection(*({r["step"] for r in g["records"]} for g in got if g["records"]))
        self.step = max(common) if common else None
        self.last = {rank: next((r["moe"] for r in g["records"] if r["step"] == self.step), [])
                     for rank, g in enumerate(got)} if common else {}
        self.config, self.loads = got[0]["config"], dict(sorted(loads.items()))
        if self.layer is not None and self.layer not in self.loads:  # a new engine without that layer
            self.layer = None
        self.refreshes, self.error = self.refreshes + 1, None
        self._redraw()

    # ------------------------------------------------------------ widgets (lazy)
    def widget(self):
        """A layer picker, Refresh, a status line, errors, the load heatmap and the traffic heatmap."""
        if self._ui is None:
            import ipywidgets as w

            options = [("all layers", None)] + [(f"layer {n}", n) for n in self.loads]
            ui = {"layer": w.Dropdown(options=options, value=self.layer, description="load of"),
                  "refresh": w.Button(description="Refresh", tooltip="read the MoE records again"),
                  "status": w.HTML(), "errors": w.Output(), "load": figure_view(self.load_figure())}
            ui["traffic"] = figure_view(self._traffic_or_note())
            ui["layer"].observe(lambda change: self.set_layer(change["new"]), names="value")
            ui["refresh"].on_click(lambda _: self.click_refresh())
            ui["box"] = w.VBox([w.HBox([ui["layer"], ui["refresh"]]), ui["status"], ui["errors"], ui["load"],
                                ui["traffic"]])
            self._ui = ui
            self._redraw()
        return self._ui["box"]

    def _redraw(self) -> None:
        ui = self._ui
        if ui is None:
            return
        how = "refreshed after each %%colossal cell" if self.watching else "Refresh to read again"
        ep = getattr(self.config, "ep", 1)
        ui["status"].value = html(f"{self.var!r}: {len(self.loads)} MoE layers, last step {self.step}, "
                                  f"ep={ep} (recorded); {how}")
        redraw(ui["load"], self.load_figure())
        redraw(ui["traffic"], self._traffic_or_note())

    def _traffic_or_note(self):
        """The traffic figure, or (ep=1) an empty figure whose title says there is no traffic to draw."""
        fig = self.traffic_figure()
        if fig is None:
            import plotly.graph_objects as go

            fig = go.Figure()
            fig.update_layout(title="no all-to-all traffic: the experts are not split (ep=1)", height=120,
                              xaxis=dict(visible=False), yaxis=dict(visible=False), plot_bgcolor="white")
        return fig

"""Every notebook run in a real browser: JupyterLab on loopback, headless Chromium (tier 4).

A module-scoped JupyterLab serves a temporary copy of ``notebooks/`` on 127.0.0.1 (free
port, random token; its own settings, runtime and IPython dirs). Chromium (Debian's
``/usr/bin/chromium``, driven by Playwright, which never downloads a browser here) loads
JupyterLab once; for each notebook the page opens it (``docmanager:open``, what a
double-click in the file browser runs: loading JupyterLab's JavaScript anew took 4-5 s of
every notebook), runs "Run All Cells" from JupyterLab's Run menu and waits until
the kernel is idle and every code cell has an execution count (or fails naming the cell
that stopped the run, or the one still running after RUN_TIMEOUT). The executed notebook
is saved (Ctrl+S) so the page can be checked against what the kernel sent:

- every ipywidgets view the kernel sent is drawn as widgets, never as a ``VBox(...)`` /
  ``FigureWidget(...)`` / ``Figure({...`` text repr, "Loading widget" or "Error displaying widget";
- every plotly figure the kernel sent is drawn (``.js-plotly-plot`` with its svg), and no
  figure is wider than the notebook's output area (its right-hand part would be cut off);
- every figure drawn on the page (a static one or a ``FigureWidget``) whose traces carry points
  draws marks for them (``MARKS``: markers, lines, bars, heatmap images... in its trace layers),
  not its axes alone; a static figure's traces on the page carry the points the kernel sent;
- ``SHOWS`` names cells (by a marker in their source) that must show a widget or a plot, a plot
  being one with its data drawn (a ``FigureWidget`` whose model lost its traces carries none);
- no cell raised or shows a traceback unless it is tagged ``raises-exception``
  (JupyterLab then keeps running the cells after it);
- the outputs ``tests/notebooks/test_notebooks.py`` expects (its ``EXPECT``) are in what the kernel sent:
  where this tier runs, that file does not run the notebooks a second time with nbclient.
- the notebook leaves nothing of its own in the temporary folder (``colab_kit_*``: a checkpoint it saved).

After each notebook its tab is closed (its widgets disposed) and its kernel shut down; a notebook that
failed closes the page too, so the next one starts in a freshly loaded JupyterLab.

A screenshot of the whole notebook goes to ``tests/screenshots/<notebook stem>.png`` when the
test fails, and for every notebook with ``CK_SCREENSHOTS=1`` (each costs about 4 s). Skipped, with the reason, only where ``/usr/bin/chromium`` or
``playwright`` is missing (``apt-get install chromium``; ``pip install playwright``);
``pytest --ignore tests/notebooks/test_browser.py`` leaves it out.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from colab_kit.notebook.cluster.watchdog import wait_ended
from tests.helpers.notebooks import CHROMIUM, NOTEBOOKS, ROOT, browser_missing, left_in_temp, temp_entries

SCREENSHOTS = ROOT / "tests" / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT = 600      # seconds per notebook, from "Run All Cells" to the last execution count
SERVER_TIMEOUT = 90    # seconds for JupyterLab to answer

SHOWS = {  # notebook -> [(marker in a cell's source, "widget" | "plot" it must show)]
    "01_quickstart.ipynb": [
        ("%colossal mesh --axis dp", "plot"),
        ("ck.widgets.ConfigPicker()", "widget"),
        ("ck.widgets.ConfigPicker()", "plot"),
        ("viz.memory_figure(memory).show()", "plot"),
        ("viz.recipe_figure", "plot"),
    ],
    "02_tensor_parallel.ipynb": [
        ("%colossal mesh --axis tp_col", "plot"),
        ("%colossal mesh --axis tp_dep", "plot"),
        ("viz.weight_owner_figure", "plot"),
        ("viz.traffic_figure", "plot"),
        ("viz.memory_figure", "plot"),
        ('explore(MODES[1])', "plot"),
        ("viz.loss_figure", "plot"),
    ],
    "03_pipeline.ipynb": [
        ("--schedule gpipe", "plot"),
        ("--schedule 1f1b", "plot"),
        ("--schedule interleaved --chunks 2", "plot"),
        ("--schedule zb-h1", "plot"),
        ("viz.bubble_figure", "plot"),
        ("stepper = ck.widgets.ScheduleStepper", "widget"),
        ("stepper = ck.widgets.ScheduleStepper", "plot"),
        ("stepper.figure().show()", "plot"),
        ("%colossal timeline", "plot"),
        ('title="Pipeline vs one process (measured)"', "plot"),
    ],
    "04_zero_and_memory.ipynb": [
        ("config by config (measured beside the estimate)", "plot"),
        ('by="place", title=', "plot"),
        ("=%colossal memory", "widget"),
        ("=%colossal memory", "plot"),
        ("%colossal memory --by place", "widget"),
        ("%colossal memory --by place", "plot"),
        ("viz.loss_figure", "plot"),
        ("viz.recipe_figure", "plot"),
    ],
    "05_sequence_parallel.ipynb": [
        ("viz.zigzag_figure", "plot"),
        ('viz.ring_figure(events, "forward")', "plot"),
        ('viz.ring_figure(events, "backward")', "plot"),
        ("viz.ulysses_figure", "plot"),
        ("viz.sequence_memory_figure", "plot"),
    ],
    "06_hybrid_and_planner.ipynb": [
        ("viz.plan_figure(cands, BUDGET)", "plot"),
        ("%colossal plan --model MODEL", "widget"),
        ("%colossal plan --model MODEL", "plot"),
        ("viz.plan_vs_measured_figure", "plot"),
        ("viz.loss_figure", "plot"),
    ],
    "07_bring_your_own_model.ipynb": [
        ("viz.accuracy_figure", "plot"),
        ("viz.loss_figure({f\"{RUN['bert']} (ring)\": bert}", "plot"),
        ("viz.loss_figure({WORDS: gpt2}", "plot"),
        ('viz.loss_figure({RUN["net"]: net}', "plot"),
    ],
    "08_where_the_time_goes.ipynb": [
        ('runs["pp=4 1f1b m=4"]], title=', "plot"),
        ('runs["dp=2 tp=2"]], title=', "plot"),
        ("%colossal profile", "plot"),
        ("%colossal memory --timeline", "plot"),
        ("roofline_figure(roofs.values())", "plot"),
    ],
    "09_mixture_of_experts.ipynb": [
        ("%colossal moe", "widget"),
        ("%colossal moe", "plot"),
        ("viz.expert_load_figure", "plot"),
        ("picker = ck.widgets.ConfigPicker()", "widget"),
        ("picker = ck.widgets.ConfigPicker()", "plot"),
        ("from colab_kit.expert.records import traffic", "plot"),
        ("bytes across tp pairs", "plot"),
        ("viz.expert_mesh_figure", "plot"),
    ],
}

# A widget or a figure shown as its Python repr: what a frontend without widget support prints.
WIDGET_AS_TEXT = re.compile(r"^\s*(?:[A-Z]\w*(?:Box|Widget|Output|Button|Tab|Accordion|Stack|Picker|Stepper)"
                            r"|Output|Figure)\((?:children=|\{|\)|layout=)", re.M)
WIDGET = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"
STDERR = "application/vnd.jupyter.stderr"


_missing = browser_missing


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


# ---------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab process on 127.0.0.1 in its own process group, and its REST API."""

    def __init__(self, workdir: Path, python: str = sys.executable, env: dict | None = None):
        self.dir = workdir / "notebooks"
        self.python = python
        shutil.copytree(ROOT / "notebooks", self.dir, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        settings = workdir / "settings"
        for plugin, values in {
            # no toasts asking about news or updates in the screenshots
            "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
            # every cell attached to the page, so cell i of the page is cell i of the .ipynb
            "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        }.items():
            path = settings / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "jupyterlab.log").open("w")
        # its own runtime and IPython dirs: the kernels' connection and cluster files stay in workdir,
        # apart from any other cluster running on this machine
        env = dict(env or os.environ, JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
                   IPYTHONDIR=str(workdir / "ipython"), JUPYTER_PLATFORM_DIRS="1")
        self.proc = subprocess.Popen(
            [python, "-m", "jupyterlab", "--no-browser",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.dir}",
             f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workdir / 'workspaces'}",
             "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--ServerApp.terminals_enabled=False", "--ServerApp.allow_root=True",  # CI runs as root
             "--LabApp.expose_app_in_browser=True"],  # window.jupyterapp: the page opens each notebook with it
            cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.logfile = workdir / "jupyterlab.log"
        deadline = time.monotonic() + SERVER_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"JupyterLab did not answer within {SERVER_TIMEOUT} s:\n{self.log_tail()}")
                time.sleep(0.5)

    def log_tail(self, n: int = 4000) -> str:
        return self.logfile.read_text(errors="replace")[-n:]

    def api(self, method: str, path: str, tries: int = 6):
        """The server's REST API. A 5xx or a refused connection is retried: jupyter_server can
        answer 500 to ``GET /api/kernels`` while a kernel is still starting (seen in CI once)."""
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        for attempt in range(tries):
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    body = r.read()
                return json.loads(body) if body else None
            except urllib.error.HTTPError as err:
                if err.code < 500 or attempt == tries - 1:
                    raise
            except urllib.error.URLError:
                if attempt == tries - 1:
                    raise
            time.sleep(0.5)

    def kernels_idle(self, connected: bool = False) -> bool:
        kernels = self.api("GET", "/api/kernels")
        return bool(kernels) and all(k["execution_state"] == "idle" and (k["connections"] or not connected)
                                     for k in kernels)

    def _descendants(self):
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop_kernels(self) -> list[str]:
        """Shut every kernel down through the API; kill whatever they started that outlives them
        (engines, controller) 30 s later. Returns the command lines of what had to be killed."""
        import psutil

        procs = self._descendants()  # taken while the kernels (and their engines) are alive
        for what in ("sessions", "kernels"):
            try:
                for k in self.api("GET", f"/api/{what}") or []:
                    self.api("DELETE", f"/api/{what}/{k['id']}")
            except OSError:  # the server is gone, or the kernel went with its session
                pass
        _, alive = wait_ended(procs, 30)  # an exited engine or controller is a zombie until PID 1 reaps it
        killed = []
        for p in alive:
            try:
                killed.append(" ".join(p.cmdline())[:200])
                p.kill()
            except psutil.NoSuchProcess:
                pass
        wait_ended(alive, 10)
        return killed

    def close(self) -> None:
        import psutil

        procs = self._descendants()
        try:
            if self.proc.poll() is None:
                try:
                    self.stop_kernels()
                    self.api("POST", "/api/shutdown")
                    self.proc.wait(timeout=20)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server's whole process group
            except ProcessLookupError:
                pass
            self.proc.wait()
            for p in procs:  # and anything that left the group (engines started in a new session)
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            self.log.close()


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - a process that just ended
        return []


def _python_of(proc) -> str:
    """The interpreter a kernel runs: its venv's ``bin/python`` as the kernelspec names it (``sys.executable``
    of the server's environment), not the file that symlink resolves to."""
    cmd = _cmdline(proc)
    return cmd[0] if cmd else ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory, binder_env):
    """JupyterLab from binder/'s environment (tests/binder_env.py): the notebooks run in what Binder builds."""
    server = Lab(tmp_path_factory.mktemp("browser"), binder_env.python, binder_env.env())
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


VIEWPORT = {"width": 1280, "height": 900}


class LabPage:
    """One JupyterLab page for the whole tier: loaded once, each notebook opened in it and closed after.
    ``get()`` loads it again when it was closed (after a failed notebook)."""

    def __init__(self, browser, lab: Lab):
        self.browser, self.lab, self.page = browser, lab, None

    def get(self):
        if self.page is None or self.page.is_closed():
            self.page = self.browser.new_page(viewport=VIEWPORT)
            self.page.goto(f"{self.lab.url}/lab?token={self.lab.token}&reset", timeout=120_000)
            self.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=120_000)
            self.page.evaluate("async () => { await window.jupyterapp.restored; }")
            self.page.keyboard.press("Control+b")  # hide the file browser: more room for the notebook
        return self.page

    def open(self, name: str):
        """The notebook ``name`` open in the page's main area, as a double-click in the file browser opens it."""
        page = self.get()
        page.evaluate("async (path) => { await window.jupyterapp.commands.execute('docmanager:open', "
                      "{path, factory: 'Notebook'}); }", name)
        page.wait_for_function("(path) => { const w = window.jupyterapp.shell.currentWidget; return w && w.context "
                               "&& w.context.path === path && w.node.querySelector('.jp-Notebook .jp-Cell'); }",
                               arg=name, timeout=120_000)
        return page

    def close_documents(self) -> None:
        """Close every tab of the main area without asking: the notebook passed and was saved (a failed one
        closes the whole page instead)."""
        if self.page is not None and not self.page.is_closed():
            self.page.evaluate("() => { for (const w of Array.from(window.jupyterapp.shell.widgets('main'))) {"
                               " if (w.context) { w.context.model.dirty = false; } w.dispose(); } }")

    def close(self) -> None:
        if self.page is not None and not self.page.is_closed():
            self.page.close()
        self.page = None


@pytest.fixture(scope="module")
def lab_page(browser, lab):
    holder = LabPage(browser, lab)
    yield holder
    holder.close()


# ---------------------------------------------------------------- the page

# What plotly.js draws for the data of a trace, by trace type: a marker, a line, a bar, a heatmap's image,
# a pie's slice. A figure that carries data and draws none of these is blank (its axes alone).
MARKS = (".scatterlayer .trace .point", ".scatterlayer .trace path.js-line", ".scatterlayer .trace .textpoint",
         ".barlayer .trace .point", ".heatmaplayer image", ".imagelayer image", ".contourlayer .trace path",
         ".boxlayer .trace path", ".pielayer .slice", ".funnellayer .point", ".waterfalllayer .point")

# One snapshot of the notebook as drawn: per cell its prompt, per output what the page shows.
# Cells are in notebook order (windowingMode "none" keeps them all in the DOM), so cell i here is
# cell i of the .ipynb. JupyterLab marks text outputs with data-mime-type; a plotly figure is a
# .jp-RenderedPlotly output and a widget view an unmarked panel holding the widget's elements.
SNAPSHOT_JS = """() => {
  const MARKS = %s;
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  if (!nb) return null;
  const all = (o, sel) => [...(o.matches(sel) ? [o] : []), ...o.querySelectorAll(sel)];
  const size = v => (v == null || typeof v === 'string') ? 0 : (typeof v.length === 'number' ? v.length : 0);
  return [...nb.querySelectorAll('.jp-Cell')].filter(c => c.closest('.jp-Notebook') === nb).map(c => ({
    code: c.classList.contains('jp-CodeCell'),
    prompt: (c.querySelector('.jp-InputPrompt') || {}).innerText || '',
    outputs: [...c.querySelectorAll('.jp-OutputArea-output')].map(o => ({
      mime: o.getAttribute('data-mime-type') || '',
      text: (o.innerText || '').slice(0, 3000),
      plotly_output: o.classList.contains('jp-RenderedPlotly'),
      widgets: all(o, '.jupyter-widgets').length,
      controls: o.querySelectorAll('.jupyter-widgets button, .jupyter-widgets select, .jupyter-widgets input').length,
      plots: all(o, '.js-plotly-plot').filter(p => p.querySelector('.main-svg')).length,
      // per drawn plot: the points its traces carry (as plotly.js holds them) and the marks drawn for them
      drawn: all(o, '.js-plotly-plot').filter(p => p.querySelector('.main-svg')).map(p => ({
        carried: (p._fullData || []).filter(t => t.visible === true)
          .reduce((n, t) => n + Math.max(0, ...['x', 'y', 'z', 'values', 'r'].map(k => size(t[k]))), 0),
        marks: p.querySelectorAll(MARKS).length,
      })),
      // plots drawn wider than their output area, whose right-hand part is cut off: [drawn, shown] px
      clipped: all(o, '.js-plotly-plot').map(p => p.querySelector('.main-svg')).filter(svg => svg).map(svg => {
        const r = svg.getBoundingClientRect(), box = o.getBoundingClientRect();
        return [Math.round(r.width), Math.round(box.right - r.left)];
      }).filter(([drawn, shown]) => drawn > shown + 2),
    })),
  }));
}""" % json.dumps(", ".join(MARKS))


# Each cell's kind and prompt alone, polled every second while the notebook runs: the whole SNAPSHOT_JS (every
# output's text and every figure's size, which makes Chromium lay the page out) is taken when the run ends or fails.
PROMPTS_JS = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  if (!nb) return null;
  return [...nb.querySelectorAll('.jp-Cell')].filter(c => c.closest('.jp-Notebook') === nb).map(c => ({
    code: c.classList.contains('jp-CodeCell'),
    prompt: (c.querySelector('.jp-InputPrompt') || {}).textContent || '',
  }));
}"""


def _prompt_count(prompt: str) -> str:
    m = re.search(r"\[(.*?)\]", prompt)
    return m.group(1).strip() if m else ""


def _head(cells_json, i: int) -> str:
    src = "".join(cells_json[i]["source"]).strip()
    return f"cell {i} ({src.splitlines()[0] if src else ''!r})"


def _describe(cells_json, snap, i: int) -> str:
    outs = "\n".join(f"  [{o['mime'] or 'plotly' if o['plotly_output'] else o['mime'] or 'widget'}] {o['text'][:1500]}"
                     for o in snap[i]["outputs"])
    return f"{_head(cells_json, i)}, prompt {snap[i]['prompt']!r}, shows:\n{outs or '  (nothing)'}"


def _errors(cell_snap) -> list[str]:
    """Error text shown in a cell: a traceback (or an exception line) on the stderr mime type."""
    return [o["text"] for o in cell_snap["outputs"]
            if o["mime"] == STDERR and re.search(r"Traceback|^\w*(Error|Exception)\b", o["text"], re.M)]


def _run_all(page, lab: Lab, cells_json, name: str) -> None:
    """Run All Cells from the Run menu; return once every code cell has run (or fail, describing the cells from
    a full snapshot)."""
    code = [i for i, c in enumerate(cells_json) if c["cell_type"] == "code"]
    start = time.monotonic()
    # the page says "Idle" before its kernel has started: wait for the kernel and the page's connection to it
    while not lab.kernels_idle(connected=True):
        assert time.monotonic() < start + 120, f"{name}: no kernel connected to the page within 120 s"
        time.sleep(0.5)
    deadline = time.monotonic() + RUN_TIMEOUT
    clicked = stalled_since = None
    while True:
        if clicked is None:
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            clicked = time.monotonic()
        time.sleep(1)
        cells = page.evaluate(PROMPTS_JS)
        assert cells and [c["code"] for c in cells] == [c["cell_type"] == "code" for c in cells_json], \
            f"{name}: the page's cells do not match the file's ({len(cells or [])} vs {len(cells_json)})"
        counts = {i: _prompt_count(cells[i]["prompt"]) for i in code}
        if not any(counts.values()) and time.monotonic() - clicked > 20:
            clicked = None  # the click reached a page not yet ready: nothing ran at all, so click again
            continue
        running = [i for i in code if counts[i] == "*"]  # the first one runs, the others wait their turn
        idle = not running and lab.kernels_idle()
        if idle and all(counts[i].isdigit() for i in code):
            return
        if idle:  # nothing queued, yet some cells never ran: an error stopped "Run All Cells"
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > 10:
                snap = page.evaluate(SNAPSHOT_JS)
                failed = [i for i in code if counts[i].isdigit() and _errors(snap[i])]
                never = [i for i in code if not counts[i].isdigit()]
                detail = "\n".join(_describe(cells_json, snap, i) for i in failed) or "(no error output shown)"
                pytest.fail(f"{name}: cells {never} never ran; the run stopped after:\n{detail}")
        else:
            stalled_since = None
        if time.monotonic() > deadline:
            if not running:
                pytest.fail(f"{name}: not finished after {RUN_TIMEOUT} s, though no cell is marked running")
            snap = page.evaluate(SNAPSHOT_JS)
            pytest.fail(f"{name}: not finished after {RUN_TIMEOUT} s; still running "
                        f"{_describe(cells_json, snap, running[0])}\n(queued behind it: cells {running[1:]})")


def _settle(page, timeout: float = 60) -> list:
    """Wait until no widget says it is loading and every plotly output has drawn its svg."""
    deadline = time.monotonic() + timeout
    while True:
        snap = page.evaluate(SNAPSHOT_JS)
        pending = [o for c in snap for o in c["outputs"]
                   if "Loading widget" in o["text"] or (o["plotly_output"] and not o["plots"])
                   or any(d["carried"] and not d["marks"] for d in o["drawn"])]
        if not pending or time.monotonic() > deadline:
            return snap
        time.sleep(1)


def _save(page, path: Path, problems: list) -> list:
    """Ctrl+S, then the saved cells: the kernel's own record of each output (its mime types, errors)."""
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while True:
        try:
            cells = json.loads(path.read_text())["cells"]
        except json.JSONDecodeError:  # read while being written
            cells = []
        if cells and all(c.get("execution_count") for c in cells if c["cell_type"] == "code"):
            return cells
        if time.monotonic() > deadline:
            problems.append("Ctrl+S did not save the executed notebook within 30 s: "
                            "which widgets and figures the kernel sent, and its errors, were not checked")
            return []
        time.sleep(0.5)


def _screenshot(page, path: Path) -> None:
    """The whole notebook in one picture: make the viewport as tall as the notebook, then shoot."""
    scroller = """(document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer')
                   || document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook'))"""
    width = page.viewport_size["width"]
    height = page.evaluate(f"() => {{ const p = {scroller}; return p.scrollHeight + p.getBoundingClientRect().top + 60; }}")
    page.set_viewport_size({"width": width, "height": int(min(max(height, 800), 16000))})
    page.evaluate(f"() => {{ {scroller}.scrollTop = 0; }}")
    page.wait_for_timeout(2000)  # let plotly relayout to the new size
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)


def _points(spec: dict) -> int:
    """The points a plotly figure the kernel sent carries (x, y, z, values: the longest per visible trace);
    a base64 array (``{"dtype", "bdata"}``) counts as one."""
    def size(v) -> int:
        return 1 if isinstance(v, dict) and v.get("bdata") else len(v) if isinstance(v, list) else 0
    return sum(max(size(t.get(k)) for k in ("x", "y", "z", "values", "r"))
               for t in spec.get("data", []) if t.get("visible", True) is True)


def _check(name: str, cells_json, saved, snap, may_fail: set[int], width: int) -> list[str]:
    """What is wrong with the page as drawn, given what the kernel sent (``saved``, [] when unknown)."""
    problems = []
    for i, cell in enumerate(snap):
        head, outs = _head(cells_json, i), cell["outputs"]
        sent = saved[i].get("outputs", []) if saved else []
        mimes = [m for o in sent for m in o.get("data", {})]
        drawn_widgets = [o for o in outs if not o["mime"] and not o["plotly_output"] and (o["widgets"] or o["plots"])]
        drawn_plots = [o for o in outs if o["plotly_output"] and o["plots"]]
        if mimes.count(WIDGET) > len(drawn_widgets):
            problems.append(f"{head}: the kernel sent {mimes.count(WIDGET)} widget views, the page drew "
                            f"{len(drawn_widgets)}:\n" + _describe(cells_json, snap, i))
        sent_points = [_points(o["data"][PLOTLY]) for o in sent if PLOTLY in o.get("data", {})]
        shown_points = [d["carried"] for o in outs if o["plotly_output"] for d in o["drawn"]]
        if sum(sent_points) and not any(shown_points):
            problems.append(f"{head}: the kernel sent plotly figures with {sent_points} points, the page's "
                            f"figures carry {shown_points}:\n" + _describe(cells_json, snap, i))
        if mimes.count(PLOTLY) > len(drawn_plots):
            problems.append(f"{head}: the kernel sent {mimes.count(PLOTLY)} plotly figures, the page drew "
                            f"{len(drawn_plots)}:\n" + _describe(cells_json, snap, i))
        for o in outs:
            if "Error displaying widget" in o["text"] or "Loading widget" in o["text"]:
                problems.append(f"{head}: a widget view was not drawn: {o['text'][:300]!r}")
            if o["mime"] != STDERR and not o["widgets"] and not o["plots"] and WIDGET_AS_TEXT.search(o["text"]):
                problems.append(f"{head}: a widget or figure shown as text: {o['text'][:300]!r}")
            for d in o["drawn"]:
                if d["carried"] and not d["marks"]:
                    problems.append(f"{head}: a plotly figure whose traces carry {d['carried']} points draws "
                                    f"none of them (its axes alone):\n" + _describe(cells_json, snap, i))
            for drawn, shown in o["clipped"]:
                problems.append(f"{head}: a plotly figure {drawn} px wide is cut to the {shown} px of the "
                                f"notebook's output area in a {width} px wide window")
        if i not in may_fail:
            raised = [o for o in sent if o.get("output_type") == "error"]
            for o in raised:
                tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(o.get("traceback", [])))
                problems.append(f"{head} raised {o.get('ename')}: {o.get('evalue')}\n{tb[-2000:]}")
            if not raised:  # a traceback printed to stderr (by a rank, say) without an exception here
                problems += [f"{head} shows an error:\n{e[:2000]}" for e in _errors(cell)]
    for marker, kind in SHOWS.get(name, []):
        hits = [i for i, c in enumerate(cells_json) if c["cell_type"] == "code" and _marks(marker, "".join(c["source"]))]
        if not hits:
            problems.append(f"no cell contains {marker!r} (update SHOWS in {Path(__file__).name})")
            continue
        if kind == "widget":  # a widget: its buttons, sliders, dropdowns drawn
            shown = any(o["controls"] for i in hits for o in snap[i]["outputs"])
        else:  # a plot: one whose data is drawn (a FigureWidget whose model lost its traces carries none)
            shown = any(d["marks"] for i in hits for o in snap[i]["outputs"] for d in o["drawn"])
        if not shown:
            what = kind if kind == "widget" else "plot with its data drawn"
            problems.append(f"the cell with {marker!r} shows no {what}:\n" + _describe(cells_json, snap, hits[0]))
    return problems


def _marks(marker: str, source: str) -> bool:
    """A ``SHOWS`` marker names a cell by a part of its source, or, written ``"=..."``, by all of it (a cell
    holding only ``%colossal memory``, beside others that hold more)."""
    return marker[1:] == source.strip() if marker.startswith("=") else marker in source


SLOW_START = {"[anywidget] Failed to initialize model."}
"""Page errors that say a widget was slow, not broken. anywidget rejects a model's ``ready`` promise
2 s after it starts (``AbortSignal.timeout(2000)`` in its runtime) whether or not the model then
finishes: with ranks training on the same 2 cores, plotly's large module can take longer (seen
once in about six runs of notebook 06 on 2026-12-01, the figure drawn in the end). Whether every
widget and figure was drawn is what ``_check`` counts (views sent against views drawn, points
carried against marks drawn), so a view that really failed still fails the test."""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_renders_in_a_browser(path: Path, lab: Lab, lab_page: LabPage):
    name = path.name
    cells_json = json.loads((lab.dir / name).read_text())["cells"]
    may_fail = {i for i, c in enumerate(cells_json) if "raises-exception" in c.get("metadata", {}).get("tags", [])}
    problems: list[str] = []

    def page_error(exc):
        if str(exc) not in SLOW_START:
            problems.append(f"JavaScript error in the page: {exc}")
    page = lab_page.get()
    page.on("pageerror", page_error)
    try:
        lab_page.open(name)
        t0, in_temp = time.monotonic(), temp_entries()
        _run_all(page, lab, cells_json, name)
        snap = _settle(page)
        print(f"{name}: ran in {time.monotonic() - t0:.0f} s")
        pythons = {_python_of(p) for p in lab._descendants() if "ipykernel" in " ".join(_cmdline(p))}
        assert pythons == {lab.python}, f"{name}'s kernel ran {pythons}, not binder/'s environment {lab.python}"
        saved = _save(page, lab.dir / name, problems)
        problems += _check(name, cells_json, saved, snap, may_fail, page.viewport_size["width"])
        if saved:  # the outputs tests/notebooks/test_notebooks.py expects, from this run (nbclient skips where this runs)
            from tests.helpers.notebooks import expected_problems, started_ranks
            problems += expected_problems(name, saved, started_ranks(saved))
        problems += left_in_temp(name, in_temp)
        assert not problems, f"{name} in JupyterLab:\n" + "\n\n".join(dict.fromkeys(problems))
        passed = True
    finally:
        try:  # when it failed, the picture shows where; a passing run takes one with CK_SCREENSHOTS=1 (~4 s each)
            if not locals().get("passed") or os.environ.get("CK_SCREENSHOTS") == "1":
                _screenshot(page, SCREENSHOTS / f"{path.stem}.png")
        except Exception as exc:  # noqa: BLE001 - a failed screenshot must not hide the test's own failure
            print(f"{name}: no screenshot: {exc}")
        page.remove_listener("pageerror", page_error)
        if locals().get("passed"):
            page.set_viewport_size(VIEWPORT)  # a screenshot made it as tall as the notebook
            lab_page.close_documents()
        else:  # the next notebook starts in a freshly loaded page
            lab_page.close()
        leftover = lab.stop_kernels()
        if leftover:
            print(f"{name}: killed {len(leftover)} processes that outlived the kernel: {leftover[:3]}")



def test_a_figure_drawn_without_its_data_is_reported():
    """``_check`` on made-up snapshots (no browser): a FigureWidget whose model lost its traces (axes alone,
    nothing carried) in a ``SHOWS`` cell, and a static figure carrying points that draws no marks."""
    name, marker = "06_hybrid_and_planner.ipynb", "%colossal plan --model MODEL"
    cells_json = [{"cell_type": "code", "source": [marker]}]
    saved = [{"outputs": [{"output_type": "display_data", "data": {WIDGET: {}}}]}]

    def snap(drawn, plotly_output=False):
        out = {"mime": "", "text": "Apply", "plotly_output": plotly_output, "widgets": 1, "controls": 1,
               "plots": len(drawn), "drawn": drawn, "clipped": []}
        return [{"code": True, "prompt": "[1]:", "outputs": [out]}]

    def shown(problems):
        return [p for p in problems if "no plot with its data drawn" in p or "draws none of them" in p]

    assert shown(_check(name, cells_json, saved, snap([{"carried": 9, "marks": 9}]), set(), 1280)) == []
    blank = _check(name, cells_json, saved, snap([{"carried": 0, "marks": 0}]), set(), 1280)
    assert len(shown(blank)) == 1 and "shows no plot with its data drawn" in shown(blank)[0]
    unmarked = _check(name, cells_json, saved, snap([{"carried": 9, "marks": 0}]), set(), 1280)
    assert any("carry 9 points draws none of them" in p for p in unmarked)
    sent = [{"outputs": [{"output_type": "display_data", "data": {PLOTLY: {"data": [{"x": [1, 2], "y": [3, 4]}]}}}]}]
    lost = _check("x.ipynb", cells_json, sent, snap([{"carried": 0, "marks": 0}], plotly_output=True), set(), 1280)
    assert any("the kernel sent plotly figures with [2] points" in p for p in lost)

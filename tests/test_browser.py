"""The strategy explorer in a real browser: notebooks/08_explorer.ipynb run in JupyterLab and served by Voila,
driven by headless Chromium. Moving knobs must change the shown numbers to what `minipar.estimate` says in
this process, redraw the plots, and print a broken rule's message; any console error or Python traceback on
the page, or in the server's log (the kernels write theirs there), fails the test.

Skips when Playwright or Chromium is missing, unless MINIPAR_REQUIRE_BROWSER=1 (.ci/run sets it).
MINIPAR_SCREENSHOT=1 also writes JupyterLab's final view of the dashboard to docs/explorer.png (the README's).
Screenshots of every step lie in pytest's tmp_path (printed when a test fails).
"""
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import time
from pathlib import Path

import browser
from conftest import need
import pytest

from minipar import Cluster, GPTConfig, ParallelConfig, estimate
from minipar.lessons.explorer_html import shape_of

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "08_explorer.ipynb"  # the lesson: JupyterLab runs all its cells
APP = ROOT / "notebooks" / "explorer_app.ipynb"       # the dashboard alone: what Voila serves

# the DOM contract of minipar.lessons.explorer.explorer(): ipywidgets' add_class puts these on each widget's root.
# A notebook may show several dashboards: the test drives the first.
DASHBOARD = ".minipar-explorer"
KNOB = ".minipar-knob-{}"                   # + " input" (IntText, Checkbox) or " select" (Dropdown)
SELECTS = {"schedule", "zero", "recompute", "precision", "dp_mode", "collectives"}
SUMMARY = ".minipar-summary [data-estimate]"  # JSON: the knobs, label, step_time, mfu, memory, fits, model, ...
ERROR = ".minipar-error"
PLOTS = ".minipar-plots img"
RANKING = ".minipar-ranking"
PIN, AB = ".minipar-pin", ".minipar-ab"
PAR = [f.name for f in dataclasses.fields(ParallelConfig) if f.name != "microbatches"]  # the JSON's knobs among these
TRACEBACK = "Traceback (most recent call last)"

WAIT_MS = 30_000     # one kernel round trip (estimate and plots) on a loaded 2-core machine stays far below this
RUN_ALL_MS = 120_000  # the whole lesson, "Run here"'s training included (20 s on a quiet 2-core machine)


@pytest.fixture
def start(tmp_path):
    """start(server_factory, ...) -> Server, ready; stopped however the test ends, and no process may outlive it."""
    servers = []

    def _start(factory, *args):
        servers.append(factory(*args, tmp_path / f"server{len(servers)}"))
        servers[-1].wait_ready()
        return servers[-1]
    yield _start
    for s in servers:
        assert not s.stop(), f"processes outlived SIGKILL; log: {s.log}"


def watch(page) -> list[str]:
    """Collect the page's console errors, uncaught exceptions and the kernel's tracebacks: a widget callback
    that raises prints its traceback to no cell (JupyterLab's log console, or nowhere in Voila), so read the
    kernel's messages as they arrive. The machines are offline: a request beyond the server (Voila's
    template asks a CDN for Font Awesome) is answered empty, not failed."""
    problems = []

    def frame(payload) -> None:
        data = payload.encode() if isinstance(payload, str) else payload
        at = data.find(TRACEBACK.encode())
        if at >= 0:
            text = data[at:at + 2000].decode(errors="replace")
            problems.append("kernel: " + re.sub(r"\\u001b\[[0-9;]*m", "", text))  # JSON-escaped colours out
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("websocket", lambda ws: ws.on("framereceived", frame))
    page.route(re.compile(r"^https?://(?!127\.0\.0\.1[:/])"), lambda route: route.fulfill(status=200, body=""))
    return problems


# ----------------------------------------------------------------------------- the page as a dashboard
# `dash` is the first dashboard's Locator; the JavaScript below reads the same one, document's first match.

FIRST = f"document.querySelector('{DASHBOARD}')"


def shown(dash) -> dict:
    return json.loads(dash.locator(SUMMARY).get_attribute("data-estimate"))


def plots(dash) -> list[str]:
    return dash.locator(PLOTS).evaluate_all("imgs => imgs.map(i => i.src)")


def set_knobs(dash, **knobs) -> None:
    """Type, pick or tick each knob as a user does, in the order given."""
    for name, value in knobs.items():
        knob = dash.locator(KNOB.format(name))
        if name in SELECTS:
            knob.locator("select").select_option(label=str(value))
        elif isinstance(value, bool):
            knob.locator("input").set_checked(value)
        else:
            knob.locator("input").fill(str(value))
            knob.locator("input").press("Enter")


def expected(start: dict, knobs: dict):
    """The Estimate of the notebook's model and cluster with these knobs, or the message of the rule they break."""
    cfg = GPTConfig(**start["model"])
    cluster = Cluster.preset(start["cluster"], nodes=start.get("nodes", 1))
    rows = knobs["dp"] * knobs["micro_batch"]
    try:
        par = ParallelConfig(**{k: v for k, v in knobs.items() if k in PAR},
                             microbatches=max(1, start["global_batch"] // rows))
        return estimate(cfg, par, cluster, start["global_batch"], knobs["micro_batch"])
    except ValueError as e:
        return f"ValueError: {e}"


def wait_valid(page, dash, knobs: dict, old_plots: list[str]) -> dict:
    """Wait for the summary to hold exactly these knobs, the error to be empty and the plots redrawn: no image
    left of `old_plots` (the dashboard replaces its images all at once)."""
    page.wait_for_function(
        f"""([sel, err, want]) => {{ const d = {FIRST}, e = d.querySelector(sel), r = d.querySelector(err);
             if (!e || !r || r.textContent.trim()) return false;
             const s = JSON.parse(e.getAttribute('data-estimate'));
             return Object.entries(want).every(([k, v]) => JSON.stringify(s[k]) === JSON.stringify(v)); }}""",
        arg=[SUMMARY, ERROR, knobs], timeout=WAIT_MS)
    page.wait_for_function(
        f"""([sel, old]) => {{ const srcs = [...{FIRST}.querySelectorAll(sel)].map(i => i.src);
             return srcs.length && !srcs.some(s => old.includes(s)); }}""", arg=[PLOTS, old_plots], timeout=WAIT_MS)
    return shown(dash)


def check(page, dash, start: dict, knobs: dict, old_plots: list[str]):
    """Wait for the dashboard to show the knobs' estimate (or error), and compare it with this process's."""
    want = expected(start, knobs)
    if isinstance(want, str):  # wait for this rule's message: the last move's may still be shown (a loaded
        from playwright.sync_api import TimeoutError as PlaywrightTimeout  # machine once read it)
        with contextlib.suppress(PlaywrightTimeout):  # (then the assert below shows what is there)
            page.wait_for_function(f"([sel, want]) => {FIRST}.querySelector(sel).textContent.includes(want)",
                                   arg=[ERROR, want[len("ValueError: "):]], timeout=WAIT_MS)
        text = dash.locator(ERROR).text_content().strip()
        assert text.startswith("ValueError:") and want[len("ValueError: "):] in text, (text, want)
        assert not dash.locator(SUMMARY).count(), "a summary shown for a layout that breaks a rule"
        return want
    got = wait_valid(page, dash, knobs, old_plots)
    assert got["label"] in (want.label, want.par.label)
    assert got["step_time"] == pytest.approx(want.step_time, rel=1e-9)
    assert got["mfu"] == pytest.approx(want.mfu, rel=1e-9)
    assert got["memory"] == pytest.approx(want.peak_memory, rel=1e-9)
    assert got["fits"] == want.fits
    assert f"{want.step_time:.4g} s" in dash.locator(".minipar-summary").text_content()
    return got


# From the plan's winner (dp4 tp2 pp1 ZeRO-1 with SP for llama3-8b on one DGX A100): one knob at a time, as a
# user moves them, each change checked before the next (a move to the value the knob has is skipped). pp=2
# alone asks for 16 GPUs of the 8 (the error), dp=4 and tp=1 mend it, but tp=1 with sequence parallelism
# breaks a rule that unticking SP mends; ZeRO-1, GPipe, 1F1B; v=2 breaks a rule (only interleaved-1f1b has
# virtual stages), interleaving mends it.
MOVES = [("pp", 2), ("dp", 4), ("tp", 1), ("sequence_parallel", False), ("micro_batch", 2), ("zero", 1),
         ("schedule", "gpipe"), ("schedule", "1f1b"), ("virtual_stages", 2), ("schedule", "interleaved-1f1b")]


def explore(page, shots: Path) -> None:
    """The scenario both front ends run: the start (pinned as A), MOVES, then A beside the last layout."""
    dash = page.locator(DASHBOARD).first
    dash.locator(SUMMARY).wait_for(state="attached", timeout=WAIT_MS)
    start = shown(dash)
    assert start["model"] == shape_of(GPTConfig.preset("llama3-8b"))
    assert (start["cluster"], start["global_batch"], start["precision"]) == ("dgx-a100-80g", 64, "bf16")
    knobs = {k: start[k] for k in (*PAR, "micro_batch") if k in start}
    check(page, dash, start, knobs, [])
    assert start["label"] in dash.locator(RANKING).text_content(), "the winner is not in the ranking"
    dash.locator(PIN).click()
    dash.screenshot(path=shots / "0-start.png")
    last = start
    for i, (name, value) in enumerate(MOVES, 1):
        if knobs[name] == value:  # the winner had it already: nothing would change
            continue
        old = plots(dash)
        knobs[name] = value
        set_knobs(dash, **{name: value})
        got = check(page, dash, start, knobs, old)
        dash.screenshot(path=shots / f"{i}-{name}-{value}.png")
        last = got if isinstance(got, dict) else last
    ab = dash.locator(AB).text_content()
    assert last is not start and start["label"] in ab and last["label"] in ab, ab


def assert_clean(page, problems: list[str], server) -> None:
    page.wait_for_timeout(500)  # Playwright delivers events while it waits: the last kernel messages
    text = page.inner_text("body")
    assert TRACEBACK not in text and "There was an error when executing cell" not in text, text[-3000:]
    assert not problems, problems
    log = server.log_text()
    assert TRACEBACK not in log, log[-5000:]


# ----------------------------------------------------------------------------- the two front ends


@contextlib.contextmanager
def evidence(page, server, shots: Path):
    """On failure, a screenshot beside the steps' ones and the server's log in the test's output."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=shots / "failed.png")
        print(f"screenshots in {shots}\n--- server log ---\n{server.log_text()[-5000:]}")
        raise


def run_all(page) -> None:
    """Run every cell once the kernel is idle. (Run All clicked before a kernel exists runs nothing: the
    toolbar reads idle then; so wait on the session itself, and run again if a cell kept no prompt.)"""
    page.wait_for_function("() => window.jupyterapp?.shell.currentWidget?.sessionContext", timeout=WAIT_MS)
    for attempt in range(2):
        page.wait_for_function("""async () => { const nb = window.jupyterapp.shell.currentWidget;
            await nb.context.ready; await nb.sessionContext.ready;
            return nb.sessionContext.session?.kernel?.status === 'idle'; }""", timeout=WAIT_MS)
        page.evaluate("""ms => Promise.race([window.jupyterapp.commands.execute('notebook:run-all-cells'),
                                              new Promise(done => setTimeout(done, ms))])""", RUN_ALL_MS)
        if page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets
                .filter(c => c.model.type === 'code').every(c => c.model.executionCount)"""):
            return
    raise AssertionError("Run All left cells unexecuted twice")


def test_jupyterlab(chromium, start, tmp_path):
    """The lesson, every cell run in JupyterLab as a reader does (Run All), then its first dashboard explored."""
    lab = start(browser.lab, ROOT)
    page = chromium.new_page(viewport={"width": 1400, "height": 1000})
    problems, t0 = watch(page), time.monotonic()
    with evidence(page, lab, tmp_path):
        page.goto(f"{lab.url}/lab/tree/{NOTEBOOK.relative_to(ROOT)}?reset&token={lab.token}", timeout=WAIT_MS)
        run_all(page)
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # the file browser: room for the dashboard
        print(f"JupyterLab: the lesson ran in {time.monotonic() - t0:.1f} s")
        explore(page, tmp_path)
        print(f"JupyterLab: explored in {time.monotonic() - t0:.1f} s")
        assert_clean(page, problems, lab)
        if os.environ.get("MINIPAR_SCREENSHOT") == "1":
            page.set_viewport_size({"width": 1400, "height": 2400})  # the whole dashboard in view
            page.evaluate("() => document.activeElement.blur()")  # no focus ring on the last knob
            (ROOT / "docs").mkdir(exist_ok=True)
            page.locator(DASHBOARD).first.screenshot(path=ROOT / "docs" / "explorer.png")


def test_voila(chromium, start, tmp_path):
    """The app notebook served by Voila, which runs it on page load. On a loaded machine a page sometimes
    never finishes loading though its kernel has: one more load, with a fresh kernel, is allowed (printed)."""
    if importlib.util.find_spec("voila") is None:
        need("voila is not installed (pip install -e '.[dev]')")
    voila = start(browser.voila, APP)
    page = chromium.new_page(viewport={"width": 1400, "height": 1000})
    problems, t0 = watch(page), time.monotonic()
    with evidence(page, voila, tmp_path):
        for attempt in range(2):
            try:
                page.goto(f"{voila.url}/", wait_until="commit", timeout=WAIT_MS)
                page.locator(f"{DASHBOARD} {SUMMARY}").first.wait_for(state="attached", timeout=WAIT_MS)
                break
            except Exception as e:  # Playwright's TimeoutError
                if attempt:
                    raise
                print(f"Voila: no dashboard after {WAIT_MS} ms ({type(e).__name__}); loading again")
                problems.clear()  # the abandoned page's
        print(f"Voila: the dashboard shown in {time.monotonic() - t0:.1f} s")
        explore(page, tmp_path)
        print(f"Voila: explored in {time.monotonic() - t0:.1f} s")
        assert_clean(page, problems, voila)

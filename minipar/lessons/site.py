"""The lessons as a static site a learner reads without installing anything: `make docs` runs every
lesson top to bottom (nbclient, as JupyterLab would) and writes one HTML page each, with its outputs
and figures, and an index made from notebooks/README.md, into docs/lessons/.

    python -m minipar.lessons.site [NAME ...]   build all lessons, or the named ones (e.g. 03_zero)

A widget is live only in a running kernel; on a page it shows what its Output held when the lesson
ran (the figure of its default setting), under a line saying so. Each page carries, in a <meta>, the
hash of its notebook's cells (`source_hash`): tests/test_site.py fails when a lesson changed and
its page was not rebuilt, and checks every page in Chromium (loads, figures present, no error).
"""
from __future__ import annotations

import copy
import hashlib
import html
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS, SITE = ROOT / "notebooks", ROOT / "docs" / "lessons"
SKIP = {"explorer_app"}  # the explorer as an app (Voila): lesson 08 shows the same dashboard
CELL_TIMEOUT = 600       # seconds; a lesson's slowest cell takes seconds
WIDGET = "application/vnd.jupyter.widget-view+json"
STYLE = "lab.css"  # nbconvert's lab template's styles, once for every page
STILL = ("<p class=\"minipar-still\"><em>A control: in a running lesson it redraws as you move it; "
         "here, what it drew at its default setting.</em></p>")


def lessons() -> list[Path]:
    """Every lesson notebook in reading order (their names sort so: 00 ... 06, 06b, 07, 08)."""
    return [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if p.stem not in SKIP]


def source_hash(path: Path) -> str:
    """sha256 of a notebook's cell types and sources: what the page was built from."""
    cells = json.loads(path.read_text())["cells"]
    return hashlib.sha256(json.dumps([(c["cell_type"], "".join(c["source"])) for c in cells])
                          .encode()).hexdigest()


def _widget_outputs(model_id: str, state: dict, seen: set | None = None) -> list[dict]:
    """The outputs held by the Output widgets under one widget (its children, depth first)."""
    seen = set() if seen is None else seen
    if model_id in seen or model_id not in state:
        return []
    seen.add(model_id)
    model = state[model_id]["state"]
    found = list(model.get("outputs", [])) if model.get("_model_name") == "OutputModel" else []
    for child in model.get("children", []):
        found += _widget_outputs(str(child).removeprefix("IPY_MODEL_"), state, seen)
    return found


def _stills(nb) -> int:
    """Replace each widget view by what its Output widgets held, under a line saying so; returns
    how many widgets were replaced. The pages load no widget JavaScript (it comes from a CDN)."""
    state = nb.metadata.pop("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    state = state.get("state", {})
    replaced = 0
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET)
            if view is None:
                outputs.append(out)
                continue
            replaced += 1
            outputs.append({"output_type": "display_data", "metadata": {},
                            "data": {"text/html": STILL}})
            outputs += copy.deepcopy(_widget_outputs(view["model_id"], state))
        cell["outputs"] = outputs
    return replaced


def execute(path: Path):
    """Run one lesson in a fresh kernel with the notebooks folder as its working directory; returns
    the executed notebook and the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    return nb, time.perf_counter() - start


def cell_seconds(nb) -> list[tuple[float, int]]:
    """(seconds, cell index) of each code cell, from the timing nbclient records, slowest first."""
    from datetime import datetime

    times = []
    for i, cell in enumerate(nb.cells):
        run = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in run and "shell.execute_reply" in run:
            start, end = (datetime.fromisoformat(run[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            times.append(((end - start).total_seconds(), i))
    return sorted(times, reverse=True)


def _provenance(seconds: float) -> str:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return (f"Run on {time.strftime('%Y-%m-%d')} at commit {commit}, in {seconds:.0f} s on "
            f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, "
            f"Python {platform.python_version()}.")


def page(path: Path, nb, seconds: float) -> str:
    """One lesson's HTML: nbconvert's lab template, its widgets as stills, a header bar linking the
    index and the neighbours, and the provenance line."""
    from nbconvert import HTMLExporter

    _stills(nb)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    styles = re.findall(r"<style[^>]*>.*?</style>", body, flags=re.S)
    (SITE / STYLE).write_text("\n".join(re.sub(r"</?style[^>]*>", "", s) for s in styles))
    body = re.sub(r"<style[^>]*>.*?</style>\s*", "", body, flags=re.S)
    body = re.sub(r"<script src=\"[^\"]*require[^\"]*\"></script>\s*", "", body)
    if "class=\"jp-Mermaid" not in body:   # nbconvert's diagram loader, ~420 lines, for none
        body = re.sub(r"<script type=\"module\">.*?</script>\s*<!-- End of mermaid "
                      r"configuration -->", "", body, flags=re.S)
    title = next((c.source.lstrip("# ").splitlines()[0] for c in nb.cells
                  if c.cell_type == "markdown" and c.source.startswith("# ")), path.stem)
    body = body.replace("<title>Notebook</title>", f"<title>{html.escape(title)}</title>", 1)
    body = body.replace("No description has been provided for this image",
                        "a figure the lesson drew")
    figures = body.count("src=\"data:image/png")
    names = [p.stem for p in lessons()]
    i = names.index(path.stem)
    links = ["<a href=\"index.html\">all lessons</a>"]
    if i > 0:
        links.insert(0, f"<a href=\"{names[i - 1]}.html\">&larr; {names[i - 1]}</a>")
    if i + 1 < len(names):
        links.append(f"<a href=\"{names[i + 1]}.html\">{names[i + 1]} &rarr;</a>")
    bar = (f"<nav class=\"minipar-nav\" style=\"padding:.5em 1em;font-family:sans-serif\">"
           f"{' · '.join(links)}<br><small>{html.escape(_provenance(seconds))} The notebook: "
           f"<code>notebooks/{path.name}</code>.</small></nav>")
    meta = (f"<meta name=\"minipar-source\" content=\"{source_hash(path)}\">"
            f"<meta name=\"minipar-figures\" content=\"{figures}\">"
            f"<meta name=\"minipar-seconds\" content=\"{seconds:.1f}\">"
            f"<link rel=\"stylesheet\" href=\"{STYLE}\">")
    body = body.replace("<head>", "<head>" + meta, 1)
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + bar, body, count=1)


def index() -> str:
    """notebooks/README.md as the site's first page, its links to notebooks pointing at pages."""
    from nbconvert.filters import markdown2html

    text = (NOTEBOOKS / "README.md").read_text()
    text = re.sub(r"\]\(([0-9][0-9a-z_]*)\.ipynb\)", r"](\1.html)", text)
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>minipar lessons</title>"
            "<style>body{max-width:60em;margin:2em auto;padding:0 1em;font-family:sans-serif;"
            "line-height:1.45}code,pre{background:#f4f4f4}</style></head><body>"
            + markdown2html(text) + "</body></html>\n")


def build(names: list[str] | None = None) -> list[tuple[str, float, int]]:
    """Build the named lessons' pages (all by default) and the index; returns (lesson, seconds,
    figures) for each page built."""
    SITE.mkdir(parents=True, exist_ok=True)
    done = []
    for path in lessons():
        if names and path.stem not in names:
            continue
        nb, seconds = execute(path)
        slow = ", ".join(f"cell {i} {t:.1f} s" for t, i in cell_seconds(nb)[:3])
        text = page(path, nb, seconds)
        (SITE / f"{path.stem}.html").write_text(text)
        figures = int(re.search(r"minipar-figures\" content=\"(\d+)", text).group(1))
        done.append((path.stem, seconds, figures))
        print(f"{path.stem:<22} {seconds:6.1f} s  {figures:3d} figures  (slowest: {slow})",
              flush=True)
    (SITE / "index.html").write_text(index())
    return done


if __name__ == "__main__":
    build(sys.argv[1:] or None)

"""The lessons as a static site (docs/lessons/, built by `make docs`): a page for every lesson, built from
the notebook as it is now, and readable: in headless Chromium every page loads without an error, shows
every figure it was built with, and carries no traceback.

The pages are built on purpose outside the test run (executing the lessons takes minutes and their outputs
are what a learner reads); this test only fails when a lesson's cells changed after its page was built.
"""
import re

import pytest

from minipar.lessons import site

PAGES = [p.stem for p in site.lessons()]
TRACEBACK = "Traceback (most recent call last)"


def meta(text: str, name: str) -> str:
    found = re.search(rf"<meta name=\"minipar-{name}\" content=\"([^\"]*)\"", text)
    assert found, f"no minipar-{name} <meta>: not a page that minipar.lessons.site built"
    return found.group(1)


@pytest.mark.parametrize("name", PAGES)
def test_every_lesson_has_a_page_built_from_its_current_cells(name):
    page = site.SITE / f"{name}.html"
    assert page.exists(), f"no {page.relative_to(site.ROOT)}: run `make docs`"
    assert meta(page.read_text(), "source") == site.source_hash(site.NOTEBOOKS / f"{name}.ipynb"), (
        f"notebooks/{name}.ipynb changed after its page was built: run "
        f"`.venv/bin/python -m minipar.lessons.site {name}` (or `make docs`) and commit the page")


def test_the_index_links_every_page():
    text = (site.SITE / "index.html").read_text()
    for name in PAGES:
        assert f'href="{name}.html"' in text, f"index.html has no link to {name}.html"


def test_a_stale_page_is_caught(tmp_path, monkeypatch):
    """The staleness check can fail: one changed character in a cell changes the hash."""
    original = site.NOTEBOOKS / f"{PAGES[0]}.ipynb"
    changed = tmp_path / original.name
    changed.write_text(original.read_text().replace("Lesson", "Lessn", 1))
    assert site.source_hash(changed) != site.source_hash(original)


def test_every_page_reads_in_chromium(chromium):
    """Offline, as the test machines are: MathJax's CDN request is answered empty, so formulas show as TeX."""
    context = chromium.new_context()
    page = context.new_page()
    problems = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.route(re.compile(r"^https?://"), lambda route: route.fulfill(status=200, body=""))
    for name in ["index", *PAGES]:
        path = site.SITE / f"{name}.html"
        page.goto(path.as_uri(), wait_until="load")
        assert page.locator("body").inner_text().strip(), f"{name}.html shows nothing"
        if name == "index":
            continue
        figures = page.evaluate("""() => [...document.images].filter(
            i => i.src.startsWith('data:image/png') && i.complete && i.naturalWidth > 0).length""")
        built = int(meta(path.read_text(), "figures"))
        assert figures == built > 0, f"{name}.html shows {figures} figures of the {built} it was built with"
        errors = page.locator("[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
        assert not any(TRACEBACK in e for e in errors), f"{name}.html has a traceback: {errors}"
        assert page.locator(".jp-OutputArea-output").count(), f"{name}.html has no outputs"
    assert not problems, problems
    context.close()

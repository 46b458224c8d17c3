import os
import sys
import tempfile

import pytest

# Worker functions live in modules under tests/ (tests/ is not a package); put tests/ on sys.path so
# they import by name here and in the worker processes that minipar.launch starts.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The CPU's measured matmul peak (MFU's denominator) is cached under XDG_CACHE_HOME: a run of the
# tests measures its own, in a folder of its own, rather than reuse (or overwrite) the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="minipar-test-cache-")


# ----------------------------------------------------------------------------- headless Chromium
# tests/test_browser.py (the explorer in JupyterLab and Voila) and tests/test_site.py (the static pages)


def need(reason: str):
    if os.environ.get("MINIPAR_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (MINIPAR_REQUIRE_BROWSER=1: `make test` installs Chromium with apt-get)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium():
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        need("playwright is not installed (pip install -e '.[dev]')")
    import browser

    path = browser.chromium()  # None: Playwright's own download, where `playwright install` could fetch one
    with sync_playwright() as p:
        try:
            chrome = p.chromium.launch(executable_path=path, args=browser.CHROMIUM_ARGS)
        except Error as e:
            need(f"no Chromium to drive (apt-get install chromium): {str(e).splitlines()[0]}")
        yield chrome
        chrome.close()

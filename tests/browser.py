"""A notebook server and a headless browser for tests/test_browser.py.

`lab(...)` and `voila(...)` start the server on 127.0.0.1 in a process group of its own, with Jupyter's
config, data and runtime dirs (and notebook checkpoints) in a temp folder: the user's ~/.jupyter and the
repository are neither read nor written; widgets' JavaScript still comes from the venv's share/jupyter.
`Server.stop()` kills the server and every process below it by pid, kernels included (they run in sessions of
their own), in bounded time. The server also dies with the test process, however that dies (PR_SET_PDEATHSIG),
and its kernels then exit by themselves (ipykernel watches its parent).

The browser is Debian's Chromium: `playwright install` downloads browsers, which this project's machines
cannot; Playwright drives any Chromium it is given the path of.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil  # ipykernel's own dependency

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"]
# JupyterLab's news pop-up would cover the page
LAB_CONFIG = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
# autosave off: the test must not write executed outputs back into the repository's notebook
LAB_SETTINGS = {"@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False}}


def chromium() -> str | None:
    """The path of an installed Chromium, or None."""
    return next((p for p in CHROMIUM if os.access(p, os.X_OK)), None) or shutil.which("chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the test process dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    """One server process: the browser goes to `url` (with `token`, if any); `log` holds the server's output."""

    def __init__(self, argv: list[str], cwd: Path, tmp: Path, url: str, ready: str, token: str | None = None):
        tmp.mkdir(parents=True, exist_ok=True)
        self.url, self.ready, self.token, self.log = url, ready, token, tmp / "server.log"
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   JUPYTER_PLATFORM_DIRS="1", PYDEVD_DISABLE_FILE_VALIDATION="1")  # two warnings fewer in the log
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = 60) -> None:
        """Poll `ready` until it answers 200; fail early, with the log, if the server exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.ready, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 5) -> list[int]:
        """SIGTERM the server's group and every descendant, SIGKILL what is left after `timeout` s;
        return the pids that outlived even that (none, or the test fails)."""
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2)):
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            _, procs = psutil.wait_procs(procs, timeout=wait)
            if not procs:
                break
        self.proc.wait(timeout=2)
        return [p.pid for p in procs]


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def lab(root: Path, tmp: Path, token: str = "minipar-test") -> Server:
    """JupyterLab serving `root`: the notebook at root/p opens at `url/lab/tree/p?token=...`. The page exposes
    `window.jupyterapp`, so the test runs cells with JupyterLab's own commands and sees the kernel's state."""
    _write_json(tmp / "config" / "labconfig" / "page_config.json", LAB_CONFIG)
    for name, settings in LAB_SETTINGS.items():
        _write_json(tmp / "config" / "lab" / "user-settings" / name, settings)
    port = free_port()
    argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
            "--port-retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
            f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}"]  # not notebooks/.ipynb_checkpoints
    url = f"http://127.0.0.1:{port}"
    return Server(argv, root, tmp, url, f"{url}/api/status?token={token}", token)


def voila(notebook: Path, tmp: Path) -> Server:
    """Voila rendering `notebook` alone, at `url/`; tracebacks shown, so that the test sees them."""
    port = free_port()
    argv = [sys.executable, "-m", "voila", str(notebook), "--no-browser", "--Voila.ip=127.0.0.1", f"--port={port}",
            "--Voila.port_retries=0", "--show_tracebacks=True", f"--Voila.connection_dir_root={tmp}"]
    url = f"http://127.0.0.1:{port}"
    return Server(argv, notebook.parent, tmp, url, f"{url}/voila/static/voila.js")

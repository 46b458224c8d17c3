"""The wheel works on its own: built from this checkout and installed into a fresh venv, minipar
trains on the corpus it carries, runs a lesson from its installed notebooks and samples from a
checkpoint, all from a directory that is not the repository.

About two to three minutes on 2 cores: pip's installs ~75 s (torch from the local wheel, the rest
from pip's cache), the lesson ~30 s, each CLI run ~10 s. The wheel is built from a copy of the
checkout, so no build/ or *.egg-info lands in it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSON = "02_mixed_precision.ipynb"  # a quick lesson that reads the corpus (~20 s under nbval)
KERNEL = "minipar-wheel-test"        # registered in the venv: no other python3 kernel answers
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".ipynb_checkpoints", "out")

RUN_LESSON = """
import sys, nbformat
from nbclient import NotebookClient
from minipar import data
nb = nbformat.read(data.lessons_dir() / sys.argv[1], as_version=4)
NotebookClient(nb, timeout=600, kernel_name=sys.argv[2],
               resources={"metadata": {"path": "."}}).execute()
print("executed", data.lessons_dir() / sys.argv[1])
"""


def _run(cmd, cwd, env, timeout=600) -> str:
    """Run `cmd`; its stdout and stderr together, or a failure that shows their end."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(python, env) of a fresh venv holding the minipar wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    before = sorted(p.name for p in ROOT.iterdir())
    shutil.copytree(ROOT, tmp / "src", ignore=COPY_IGNORE)  # pip wheel leaves build/ where it runs
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
          tmp / "dist", tmp / "src"], cwd=tmp, env=os.environ)
    (wheel,) = (tmp / "dist").glob("minipar-*.whl")
    assert sorted(p.name for p in ROOT.iterdir()) == before, "the build wrote into the checkout"
    # The venv sees only what it installed: no PYTHONPATH (it would import this checkout instead),
    # no user site; bytecode on, since a fresh torch compiles its modules as they are imported.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env.update(PYTHONNOUSERSITE="1", MPLBACKEND="Agg")
    _run([sys.executable, "-m", "venv", tmp / "venv"], cwd=tmp, env=env)
    python = tmp / "venv" / "bin" / "python"
    pip = [python, "-m", "pip", "install", "--no-compile", "-q"]
    _run([*pip, "torch==2.13.0"], cwd=tmp, env=env)  # first, so the wheel's range needs no other
    _run([*pip, wheel, "ipykernel", "nbclient"], cwd=tmp, env=env)
    _run([python, "-m", "ipykernel", "install", "--prefix", tmp / "venv", "--name", KERNEL],
         cwd=tmp, env=env)
    return python, env


def test_the_installed_wheel_trains_runs_a_lesson_and_samples(venv, tmp_path):
    python, env = venv
    where = _run([python, "-c", "import minipar.data as d; print(d.__file__, d.corpus_path(), "
                  "d.lessons_dir())"], cwd=tmp_path, env=env).split()
    site = Path(where[0]).parents[1]
    assert site.name == "site-packages" and ROOT not in Path(where[0]).parents
    assert Path(where[1]) == site / "minipar" / "bundled" / "data" / "shakespeare.txt"
    assert Path(where[2]) == site / "minipar" / "bundled" / "notebooks"
    assert Path(where[1]).is_file() and (Path(where[2]) / LESSON).is_file()
    assert (Path(where[2]) / "README.md").is_file()  # the series' first page travels with them
    assert (Path(where[1]).parent / "prepare_shakespeare.py").is_file()  # the error names it

    out = _run([python, "-m", "minipar", "train", "--steps", "5", "--plot", "", "--save", "ck.pt"],
               cwd=tmp_path, env=env)
    assert "loss" in out and (tmp_path / "ck.pt").is_file()

    out = _run([python, "-c", RUN_LESSON, LESSON, KERNEL], cwd=tmp_path, env=env)
    assert f"executed {where[2]}/{LESSON}" in out

    out = _run([python, "-m", "minipar", "sample", "--checkpoint", "ck.pt", "--prompt", "ROMEO:",
                "--tokens", "50"], cwd=tmp_path, env=env)
    assert "ROMEO:" in out

# The two commands the README gives. Both set up .venv first (once; again if pyproject.toml changes).
# torch==2.13.0 is installed on its own, first: it is the CPU wheel that lies on this machine's disk.
# pyproject.toml's range (2.11 <= torch < 2.14) accepts it, so `pip install -e .` adds nothing more;
# a bare `torch` would make pip fetch a multi-GB CUDA build instead.
PY := .venv/bin/python
TORCH ?= torch==2.13.0

.venv/done: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: .venv/done

# tests/test_browser.py drives Debian's Chromium (`playwright install` cannot download browsers here): install
# it where apt-get exists and it is missing, as root or through sudo; elsewhere the test skips and says why.
browser:
	@command -v chromium >/dev/null || ! command -v apt-get >/dev/null || \
	{ if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null; then sudo=sudo; else \
	  echo "Chromium missing and neither root nor sudo: tests/test_browser.py will skip"; exit 0; fi; \
	  $$sudo apt-get update -q && $$sudo apt-get install -y -q chromium; }

train: setup   ## the main job: a short data-parallel training run (2 ranks) on the bundled corpus
	$(PY) -m minipar train --dp 2 $(ARGS)

test: setup browser  ## every test: pytest, the notebooks under nbval, the explorer in Chromium
	$(PY) -m pytest --nbval-lax -q $(ARGS)

docs: setup    ## the lessons as a static site, docs/lessons/ (runs every lesson: minutes); ARGS=03_zero for one
	$(PY) -m minipar.lessons.site $(ARGS)

bench: setup   ## side-by-side benchmarks against PyTorch's own implementations
	$(PY) bench/run.py $(ARGS)

.PHONY: setup browser train test docs bench

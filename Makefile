# The two commands of README.md: `make demo` (set up + run the main job on the embedded stack) and `make test`
# (which fetches the real-world media corpus first: `make corpus`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The lock make setup and CI install: the application's exact versions with hashes, torch's CPU build (infra/lock/),
# for one machine and Python (torch's CPU wheels are per Python version)
LOCK ?= infra/lock/test.txt
LOCK_FOR := x86_64 3.11
# Elsewhere (Debian 13's Python 3.13, Ubuntu 24.04's 3.12, macOS) setup installs pyproject.toml's ranges at the lock's
# versions, torch's CPU build from TORCH_INDEX where it answers, else PyPI's (CUDA) build: infra/install_ranges.py
LOCK_FITS := $(shell $(PYTHON) infra/preflight.py --lock-for $(LOCK_FOR) --fits 2>/dev/null && echo yes)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo test lock corpus
setup: $(VENV)/.installed

# Checked before anything is installed: the Python, venv/ensurepip, free disk (infra/preflight.py, stdlib only)
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) infra/preflight.py --venv $(VENV) --lock-for $(LOCK_FOR)
	$(PYTHON) -m venv $(VENV)
ifeq ($(LOCK_FITS),yes)
	$(PY) -m pip install -q --require-hashes --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
else
	$(PYTHON) -m infra.install_ranges --venv $(VENV) --lock $(LOCK) --torch-index $(TORCH_INDEX)
endif
	touch $@

demo: setup
	$(VENV)/bin/vsrq demo --dir demo

# The real-world media corpus (tests/corpus/manifest.toml) into $$VSRQ_CORPUS_DIR or ~/.cache/vsrq/corpus: tests/test_corpus.py needs it
corpus: setup
	$(PY) tests/corpus/fetch.py

test: corpus
	# three processes on CI's two cores (with two, a fifth of the run's CPU time sat idle: tests wait on leases,
	# restarts and subprocesses; 19 min 31 s of tests -> 15 to 17 min, bench/RESULTS.md), each test file whole in one of
	# them (files share their stack), the longest files first (tests/conftest.py's LONGEST_FIRST, kept as collected);
	# FIGURE lines: run a file with -s. A process that crashes is not replaced: its replacement left the run waiting for
	# ever (xdist's loadfile, session 43), not failing
	$(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder --max-worker-restart 0

# infra/lock/*.txt from pyproject.toml's ranges, keeping the versions they pin (UPGRADE=--upgrade for the newest).
# Needs uv (`pip install uv`). The worker's and the API's images: any platform, torch's CUDA build from PyPI. The
# tests': Linux x86_64, CPython 3.11, torch's CPU build from PyTorch's CPU index (TORCH_CPU: or a folder of wheels).
UV ?= uv
TORCH_CPU ?= --extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match
COMPILE = $(UV) pip compile pyproject.toml --generate-hashes --custom-compile-command "make lock" $(UPGRADE)
lock:
	$(COMPILE) --extra worker --universal -o infra/lock/worker.txt
	$(COMPILE) --extra api --universal -c infra/lock/worker.txt -o infra/lock/api.txt
	$(COMPILE) --extra test --python-platform $(word 1,$(LOCK_FOR))-manylinux_2_28 --python-version $(word 2,$(LOCK_FOR)) \
	    $(TORCH_CPU) \
	    -c infra/lock/worker.txt -c infra/lock/api.txt -c infra/lock/cpu.txt -o infra/lock/test.txt

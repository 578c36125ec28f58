# The two commands of README.md: `make demo` (set up + run the main job on the embedded stack) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 resolves to the CPU wheel on these machines; a GPU host installs its CUDA build the same way.
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/vsrq demo --dir demo

test: setup
	# two processes, each test file whole in one of them (files share their stack); FIGURE lines: run a file with -s
	$(PY) -m pytest -n 2 --dist loadfile

# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.epd-lab-installed
NATIVE := $(wildcard native/*.pyx native/*.pxd native/*.c native/*.h)
NATIVE := $(filter-out native/_native.c native/_verbs.c,$(NATIVE))

.PHONY: demo test bench build clean

demo: build
	$(BIN)/epd-lab demo

test: build
	$(BIN)/python -m pytest -q

bench: build
	$(BIN)/epd-lab bench transfer --json data/bench/transfer.json

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: a looser pin pulls a multi-GB CUDA build (DESIGN.md §7).
# The Mooncake engine is optional: where its wheel does not install, its tests and bench row skip.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "cython>=3.0" numpy setuptools wheel
	$(BIN)/pip install -q --no-build-isolation -e '.[test]'
	$(BIN)/pip install -q --no-build-isolation -e '.[mooncake]' || echo "epd_lab: Mooncake engine not installed; its tests will skip"
	touch $@

build: $(STAMP) epd_lab/.native-built

epd_lab/.native-built: $(STAMP) $(NATIVE) setup.py
	$(BIN)/python setup.py -q build_ext --inplace
	touch $@

clean:
	rm -rf build epd_lab/*.so native/_native.c native/_verbs.c epd_lab/.native-built

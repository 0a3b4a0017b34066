# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.epd-lab-installed
NATIVE := $(wildcard native/*.pyx native/*.pxd native/*.c native/*.h)
NATIVE := $(filter-out native/_native.c native/_verbs.c,$(NATIVE))
JUPYTER_ENV := JUPYTER_CONFIG_DIR=$(CURDIR)/.jupyter/config JUPYTER_DATA_DIR=$(CURDIR)/.jupyter/data \
	JUPYTER_RUNTIME_DIR=$(CURDIR)/.jupyter/runtime IPYTHONDIR=$(CURDIR)/.jupyter/ipython

.PHONY: demo test test-quick bench build lab notebooks clean

demo: build
	$(BIN)/epd-lab demo

# Every test and notebook (CI's command). test-quick leaves out those marked slow (clusters of processes, the
# browser, campaign and fuzz legs, the notebooks): a few minutes on 2 vCPUs, for the loop of editing (docs/testing.md).
test: build
	EPD_ARTIFACTS=$(CURDIR)/.artifacts $(BIN)/python -m pytest -q

test-quick: build
	EPD_ARTIFACTS=$(CURDIR)/.artifacts $(BIN)/python -m pytest -q -m "not slow"

# JupyterLab on loopback, with Jupyter's config, data and runtime dirs inside the project (.jupyter/); as root
# too. The command line is scripts/lab.sh, which the tests run.
lab: build
	mkdir -p .jupyter
	$(JUPYTER_ENV) scripts/lab.sh

# Re-run every notebook in place (the committed outputs). Widget state is not stored: plotly's FigureWidget
# would put its whole JavaScript bundle (5 MB) into the file.
notebooks: build
	mkdir -p .jupyter
	$(JUPYTER_ENV) $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 \
		--ExecutePreprocessor.store_widget_state=False notebooks/*.ipynb

bench: build
	$(BIN)/epd-lab bench transfer --json data/bench/transfer.json

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned to the version of the CPU-only wheel pip finds locally (torch 2.13.0+cpu, through its
# find-links): with a looser pin pip may take a newer torch from the index, whose Linux wheel is the CUDA build
# with multi-GB nvidia-* dependencies; installed first, it is already satisfied when the packages below need it.
# The Mooncake engine is optional: where its wheel does not install, its tests and bench row skip.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "cython>=3.0" numpy setuptools wheel
	$(BIN)/pip install -q --no-build-isolation -e '.[test,ray]'
	$(BIN)/pip install -q --no-build-isolation -e '.[mooncake]' || echo "epd_lab: Mooncake engine not installed; its tests will skip"
	# jsonschema's format checker pulls rfc3987-syntax, which adds ~1.7 s to the start of every Jupyter process
	# and to plotly's first show(); without it the checker skips that one format.
	$(BIN)/pip uninstall -q -y rfc3987-syntax || true
	touch $@

build: $(STAMP) epd_lab/.native-built

epd_lab/.native-built: $(STAMP) $(NATIVE) setup.py
	$(BIN)/python setup.py -q build_ext --inplace
	touch $@

clean:
	rm -rf build epd_lab/*.so native/_native.c native/_verbs.c epd_lab/.native-built

# make demo / make test set up a fresh machine themselves.
# TORCH_SPEC picks the torch build; a plain "torch" on a fresh machine pulls a multi-GB CUDA
# build, so CI passes TORCH_SPEC=torch==2.13.0 (the CPU build on local disk).
PYTHON ?= python3
TORCH_SPEC ?= torch>=2.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ringcc-installed
PYTEST_ARGS ?=
# make test's pytest workers (pytest-xdist); CI's machine has 2 cores
TEST_WORKERS ?= 2

.PHONY: setup demo test test-zoo test-zoo-moe test-zoo-offline test-soak test-versions zoo-matrix clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# PYTHONWARNINGS: setuptools warns about editable installs of mapped packages on every install
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ringcc demo

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu and not zoo and not zoo_moe and not zoo_offline and not soak and not versions" $(PYTEST_ARGS)

test-zoo: $(STAMP)
	$(PY) -m pytest -q -m "zoo" $(PYTEST_ARGS)

# the mixture-of-experts models with their load-balancing loss, at p = 2 and 4
test-zoo-moe: $(STAMP)
	$(PY) -m pytest -q -m "zoo_moe" $(PYTEST_ARGS)

# the offline path (ringcc rewrite, ringcc plan) over every decoder and encoder of the zoo
test-zoo-offline: $(STAMP)
	$(PY) -m pytest -q -m "zoo_offline" $(PYTEST_ARGS)

# the zoo's core under each tested transformers release (tests/versions.py), each installed into
# .venv-versions/<release>/ on first use; writes their columns of docs/compatibility.md
test-versions: $(STAMP)
	$(PY) tests/versions.py $(if $(PYTEST_ARGS),--pytest-args $(PYTEST_ARGS))

test-soak: $(STAMP)
	$(PY) -m pytest -q -m "soak and not gpu" $(PYTEST_ARGS)

# docs/compatibility.md from a run of the model zoo (tests/zoo.py)
zoo-matrix: $(STAMP)
	$(PY) tests/zoo.py --matrix

clean:
	rm -rf $(VENV) .venv-versions build *.egg-info

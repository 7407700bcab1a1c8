# Two entry points for a fresh machine with only Python 3.11+:
#   make train   install what the main job needs, then train the tiny model on 8 simulated devices
#   make test    install the package with its test tools, then lint (ruff) and run the fast tier (at most 10 minutes
#                on 2 cores: every package, each axis against one device, exact resume, refusals, golden layouts)
#   make test-all  install and lint as `make test`, then run every test: TPU compiles, loss floors, multi-process
#                and fault runs (at most 25 minutes; `.ci/run` calls it)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test test-all

# The fast tier leaves out what these markers name (pyproject.toml says what each holds). Workers steal queued
# tests from each other (--dist worksteal): handed out in fixed chunks, the slowest (TPU compiles, floor runs) left
# one of two workers idle for about two minutes at the end of a 27-minute run.
FAST := not slow and not tpu_aot and not multiprocess and not faults

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[dev,tpu-aot]'
	touch $@

train: $(VENV)/.installed
	$(PY) -m spmd_train train configs/tiny.yaml

test: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	SPMD_TRAIN_TIER=fast $(PY) -m pytest -q -n auto --dist worksteal -m "$(FAST)" --durations=10

test-all: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	SPMD_TRAIN_TIER=all $(PY) -m pytest -q -n auto --dist worksteal --durations=25

# make golden              rewrite tests/golden/*.json (per-config parameter specs, collectives, memory;
# make golden CONFIG=tiny  see docs/describe.md "Golden layouts") after an intended layout change
.PHONY: golden
golden: $(VENV)/.installed-dev
	$(PY) -m tests.golden_layouts --write $(if $(CONFIG),--config $(CONFIG))

# make docs   rewrite docs/reference/ (config.md from the config schema, cli.md from the command's parser);
#             tests/test_reference_docs.py fails while the checked-in pages differ from what the code makes
.PHONY: docs
docs: $(VENV)/.installed
	$(PY) -m spmd_train.cli.reference_docs --write

# Two entry points for a fresh machine with only Python 3.11+:
#   make train   install what the main job needs, then train the tiny model on 8 simulated devices
#   make test    install the package with its test tools, then lint (ruff) and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test

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
	$(PY) -m pytest -q -n auto --durations=25

# make golden              rewrite tests/golden/*.json (per-config parameter specs, collectives, memory;
# make golden CONFIG=tiny  see docs/describe.md "Golden layouts") after an intended layout change
.PHONY: golden
golden: $(VENV)/.installed-dev
	$(PY) -m tests.golden_layouts --write $(if $(CONFIG),--config $(CONFIG))

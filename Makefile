# Two entry points for a fresh machine with only Python 3.11+:
#   make train   install what the main job needs, then train the tiny model on 8 simulated devices
#   make test    install the package with its test tools, then run the whole test suite
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
	$(PY) -m pytest -q -n auto

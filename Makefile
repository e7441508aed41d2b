# Two entry points, each doing its own set-up on a machine with only Python:
#   make demo   - run the main job
#   make test   - run the test suite
#   make test-clients - the client-compatibility tier: released RL clients in their own venv
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; a machine that already has a CUDA build in the venv keeps it.
TORCH  ?= torch==2.13.0

# The client tier's virtualenv: torch, this project, the pinned clients (--no-deps) and what they import.
# The interpreter of the tier's venv (CLIENTS_PYTHON=python3.12 tries the clients on another Python).
CLIENTS_VENV   ?= .venv-clients
CLIENTS_PYTHON ?= $(PYTHON)
CPY            := $(CLIENTS_VENV)/bin/python

.PHONY: install demo test test-clients lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[worker,k8s,test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

$(CLIENTS_VENV)/.installed: pyproject.toml tests/clients/clients.txt tests/clients/requirements.txt
	$(CLIENTS_PYTHON) -m venv $(CLIENTS_VENV)
	$(CPY) -c "import torch" 2>/dev/null || $(CPY) -m pip install -q "$(TORCH)"
	$(CPY) -m pip install -q -e ".[worker]" pytest pytest-timeout pytest-xdist pytest-aiohttp -r tests/clients/requirements.txt
	$(CPY) -m pip install -q --no-deps --ignore-requires-python -r tests/clients/clients.txt
	touch $@

test-clients: $(CLIENTS_VENV)/.installed
	$(CPY) -m pytest -q -n 2 --dist loadfile tests/clients

# ruff (lint + format) and mypy, as CI runs them
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .pytest_cache build *.egg-info

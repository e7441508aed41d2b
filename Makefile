# Two entry points, each doing its own set-up on a machine with only Python:
#   make demo   - run the main job
#   make test   - run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; a machine that already has a CUDA build in the venv keeps it.
TORCH  ?= torch==2.13.0

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[worker,test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

# ruff (lint + format) and mypy, as CI runs them
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

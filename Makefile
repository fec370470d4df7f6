PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# 2 workers: CI has 2 cores and the interpreter is single-threaded.
PYTEST_WORKERS ?= 2

.PHONY: run test install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,bench,hf]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python -m tritonformer info
	$(BIN)/python -m tritonformer bench

test: install
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -p no:cacheprovider

clean:
	rm -rf $(VENV) build src/*.egg-info

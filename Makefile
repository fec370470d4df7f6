PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# 2 workers: CI has 2 cores and the interpreter is single-threaded.
PYTEST_WORKERS ?= 2

# The newest transformers release that pyproject admits, laid over the venv's for the HF tests
# (transformers alone: its dependencies stay as constraints.txt pins them, and one it outgrows fails here).
HF_LATEST := .hf-latest
HF_RANGE := $(shell sed -n 's/.*"\(transformers[^"]*\)".*/\1/p' pyproject.toml)

.PHONY: run test test-hf-latest install clean

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

test-hf-latest: install
	rm -rf $(HF_LATEST)
	$(BIN)/python -m pip install -q --no-deps --target $(HF_LATEST) "$(HF_RANGE)"
	PYTHONPATH=$(HF_LATEST) $(BIN)/python -c "import transformers; print('HF tests on transformers', transformers.__version__)"
	PYTHONPATH=$(HF_LATEST) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -p no:cacheprovider tests/test_hf.py tests/test_generate.py

clean:
	rm -rf $(VENV) $(HF_LATEST) build src/*.egg-info

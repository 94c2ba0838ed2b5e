# make run        the embedded default training run (creates .venv on first use)
# make test       the whole test suite, as CI runs it (.ci/run)
# make test-fast  the fast tier for the inner loop: every test not marked slow (2-2.5 minutes alone on 2 cores)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: run test test-fast

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the package's dependencies change (the stamp records the last install).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/mtjax train

test: $(VENV)/.installed-test
	$(BIN)/pytest -q $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-test
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

# make run        the embedded default training run (creates .venv on first use)
# make test       the whole test suite, as CI runs it (.ci/run)
# make test-fast  the fast tier for the inner loop: every test not marked slow
#
# Both test targets run on two pytest-xdist workers, one per core of the 2-core CI
# machine (each imports jax and torch and holds about 2 GiB by the end of the suite, far
# below the 24 GiB there), and hand out whole files (--dist loadfile), so a module-scoped
# fixture is built once, by the one worker that runs its file. A test writes only under
# its own temporary directory and uses no fixed port or global file, so none has to run
# alone. XDIST= runs the suite in one process. Measured 2026-12-01 on the shared 2-core
# machine, under a load of 12-23 from other jobs (so no clean speed-up figure): in one
# process the first 160 tests took 19.4 min; on two workers 638 tests passed in 64.6 min
# (stopped at 92%). The same suite took 20.2 min in one process on a quiet machine.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
XDIST ?= -n 2 --dist loadfile

.PHONY: run test test-fast

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the package's dependencies change (the stamp records the last
# install that works). The stamp is written only once the installed command starts and
# every mtjax module imports, so a failed or incomplete install is retried by the next make.
CHECK_INSTALL = $(BIN)/mtjax --help >/dev/null && $(BIN)/python -c "import importlib, pkgutil, mtjax; \
	[importlib.import_module(m.name) for m in pkgutil.walk_packages(mtjax.__path__, 'mtjax.') if m.name != 'mtjax.__main__']" \
	|| { echo "make: the installed mtjax does not start (above); nothing is stamped, the next make installs again" >&2; exit 1; }

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	rm -f $@
	$(BIN)/pip install -q -e .
	$(CHECK_INSTALL)
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	rm -f $@ $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	$(CHECK_INSTALL)
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/mtjax train

test: $(VENV)/.installed-test
	$(BIN)/pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-test
	$(BIN)/pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

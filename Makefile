# WhaleZen: two commands. `make run` sets up and starts the service; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
HOST ?= 127.0.0.1

.PHONY: run test setup migrate seed clean mutation

$(VENV)/.installed-dev: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# The Python client and `whalezen` CLI (whalezen/), editable: `.venv/bin/whalezen` runs this checkout's code.
$(VENV)/.installed-cli: $(VENV)/.installed-dev pyproject.toml
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet --no-deps -e .
	touch $@

setup: $(VENV)/.installed-dev $(VENV)/.installed-cli

migrate: setup
	$(PY) manage.py migrate --noinput

seed: migrate
	$(PY) manage.py seed_demo

# serve supervises web, worker and beat and the demo agents; Ctrl-C or SIGTERM (to make, serve or the
# whole group) stops all of it, and running it again gives the same demo (same tokens, same nodes).
run: seed
	$(PY) manage.py serve --host $(HOST) --port $(PORT)

# Two pytest-xdist workers: most tests wait on processes, servers and sockets rather than a core, so two
# workers halve the suite's wall time even on a 2-core machine. `make test TEST_WORKERS=0` runs serially.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Mutation testing (mutmut) of the modules listed under [tool.mutmut] in pyproject.toml; not part of CI
# (about an hour on 2 cores). Incremental: a second run re-tests only what changed. Survivors are listed
# at the end; `$(VENV)/bin/mutmut show NAME` prints one. docs/mutation.md has the last result.
$(VENV)/.installed-mutation: $(VENV)/.installed-dev requirements-mutation.txt
	$(PY) -m pip install --quiet -r requirements-mutation.txt
	touch $@

mutation: $(VENV)/.installed-mutation
	$(VENV)/bin/mutmut run --max-children $(or $(JOBS),2)
	$(VENV)/bin/mutmut results

clean:
	rm -rf var .pytest_cache mutants

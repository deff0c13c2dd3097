# WhaleZen: two commands. `make run` sets up and starts the service; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
HOST ?= 127.0.0.1

.PHONY: run test setup migrate seed clean

$(VENV)/.installed-dev: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed-dev

migrate: setup
	$(PY) manage.py migrate --noinput

seed: migrate
	$(PY) manage.py seed_demo

# serve supervises web, worker and beat and the demo agents; Ctrl-C or SIGTERM (to make, serve or the
# whole group) stops all of it, and running it again gives the same demo (same tokens, same nodes).
run: seed
	$(PY) manage.py serve --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf var .pytest_cache

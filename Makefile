# Tessera's developer commands. `make demo` and `make test` work on a fresh Debian machine:
# both run `setup` first (.ci/setup: Debian packages, Python 3.11, the venv, the package).

VENV ?= .venv
PYTHON ?= python3.11
PYTEST_ARGS ?=
# where `make demo` delivers: a folder, or s3://BUCKET/PREFIX (FARM_S3_* and AWS_* configure it)
OUTPUT ?= render/example

PY := $(VENV)/bin/python
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

.PHONY: help setup demo test test-stack lint bench example clean addon chaos

help:
	@echo "make demo     set up, then render the example scene through the embedded farm"
	@echo "make test     set up, then ruff, mypy and the whole pytest suite"
	@echo "make test-stack  build the images, drive docker-compose.yml end to end (podman or Docker)"
	@echo "make chaos    the long chaos run (root, ~10 min): seeded faults, then every promise checked (SEED=N)"
	@echo "make setup    install what is missing (Debian packages, venv, pip packages)"
	@echo "make lint     ruff and mypy only"
	@echo "make bench    run every bench/*.py"
	@echo "make example  regenerate farm/examples/example.blend from make_example.py"
	@echo "make clean    remove caches and render output (keeps the venv)"
	@echo "make addon    build the Blender add-on zip dist/tessera_submit.zip"
	@echo "variables: VENV=$(VENV) PYTHON=$(PYTHON) PYTEST_ARGS=$(PYTEST_ARGS) OUTPUT=$(OUTPUT)"

setup:
	@VENV='$(VENV)' PYTHON='$(PYTHON)' .ci/setup

demo: setup
	$(VENV)/bin/farm render farm/examples/example.blend --output '$(OUTPUT)'

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# pytest exits 5 when it collected no tests; that is a failure here too, with a reason.
test: lint
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc

# The container images built and docker-compose.yml driven end to end as a user would, then torn
# down; prints each phase's time (deploy/stack/test-stack says what it needs and does).
test-stack: setup
	@VENV='$(VENV)' deploy/stack/test-stack

bench: setup
	@shopt -s nullglob; for bench in bench/*.py; do \
		grep -q '__main__' "$$bench" || continue; \
		echo "== $$bench"; $(PY) "$$bench"; \
	done

example: setup
	$(PY) farm/examples/make_example.py farm/examples/example.blend

# the Blender add-on: install the zip in Blender (Preferences > Add-ons > Install from Disk)
addon:
	$(PYTHON) addon/build_zip.py dist/tessera_submit.zip

clean:
	rm -rf render/ out/ build/ dist/ .pytest_cache/ .mypy_cache/ .ruff_cache/ .hypothesis/ ./*.egg-info
	find . \( -path ./.git -o -path ./.venv -o -path './$(VENV)' \) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# The long chaos run (root: network namespaces, a tmpfs): about 10 minutes of seeded random
# faults against real workers, then a table of faults by kind and outcome (SEED=N repeats one).
SEED ?=
chaos: setup
	$(PY) -m tests.chaos $(if $(SEED),--seed $(SEED)) --workers 3 --jobs 16 --faults 45 \
		--duration 480 --samples 300

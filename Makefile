# turnkeeper: `make run` starts the server, `make test` lints, type-checks and runs the tests
# (`make lint`: ruff and mypy only).
# Both install what is missing first (as root on Debian: apt packages; always: .venv).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := espeak-ng sox alsa-utils chromium chromium-driver redis-server
STAMP := $(VENV)/.installed
# pytest-xdist workers: most tests wait on real-time audio (with two workers
# the 2 cores were idle half the time), so three share a 2-core machine well:
# the suite takes about 14 min with three, 18.5 with two; the few tests marked
# serial (real-time echo alignment) run alone afterwards
TEST_WORKERS ?= 3

.PHONY: run test lint deps apt venv bench clean

run: deps
	$(BIN)/turnkeeper serve

LINT_PATHS := clock turn media voice web testkit client demo_shop tests bench
TYPED_PATHS := clock turn media voice web testkit client demo_shop

test: deps
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy $(TYPED_PATHS)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m 'not serial' --durations=25
	$(BIN)/python -m pytest -m serial

# ruff (lint and import order) and mypy only; `make test` runs them first too.
lint: deps
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy $(TYPED_PATHS)

bench: deps
	$(BIN)/python bench/bargein.py

deps: apt venv

# Debian packages the server and the tests use; installed only when missing.
apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if ! $(PYTHON) -c 'import venv, ensurepip' >/dev/null 2>&1; then missing="$$missing python3-venv"; fi; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO=sudo; \
	  else echo "need root (or sudo) to apt-get install:$$missing" >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

venv: $(STAMP)

# The end-of-turn model's file (voice/end_of_turn.py) ships in Pipecat's wheel: that wheel alone is
# installed, pinned in constraints.txt, without its dependencies (numba and others we do not run).
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "need Python >= 3.11 (found $$($(PYTHON) --version))" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt pipecat-ai
	touch $(STAMP)

clean:
	rm -rf $(VENV) var *.egg-info

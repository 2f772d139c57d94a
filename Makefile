# Two entry points for a fresh clone: `make demo` and `make test`. Each creates .venv on first
# use and reinstalls only when pyproject.toml or constraints.txt (the pinned versions) changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-slow lint format clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip -c constraints.txt
	$(PY) -m pip install --quiet -e ".[dev]" -c constraints.txt --build-constraint constraints.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks.convergence --quick

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -m "not slow"

# the edit loop: ruff and the unit tests (< 2 minutes); CI runs `make test` and `make test-slow`
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -m "not slow and not integration"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

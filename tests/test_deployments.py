"""prefect.yaml and params.yaml agree: one deployment per stage flow, on the pool that
params.yaml assigns to the stage, with an entrypoint that exists."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from moe.config import STAGES, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_stage_has_a_deployment_on_its_pool() -> None:
    cfg = load_config(ROOT / "params.yaml")
    deployments = {
        d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }
    assert set(STAGES) | {"pipeline"} == set(deployments)
    for stage in STAGES:
        assert deployments[stage]["work_pool"]["name"] == cfg.pools.stages[stage]
    for d in deployments.values():
        module, func = d["entrypoint"].split(":")
        flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), func)
        assert flow.name in (d["name"], "pipeline")
    assert all(s["active"] is False for s in deployments["pipeline"]["schedules"])

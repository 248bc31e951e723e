"""The pipeline flow: every stage in order, in this process (the laptop driver)."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from flows.stages import STAGE_FLOWS
from moe.config import STAGES, load_config

log = logging.getLogger(__name__)


@flow(name="pipeline", log_prints=True)
def pipeline(
    params_file: str | None = None,
    overrides: list[str] | None = None,
    stages: list[str] | None = None,
) -> dict[str, Any]:
    """Run `stages` (default: all) in order as subflows; stops at the first failure."""
    load_config(params_file, overrides or [])  # validate once before any stage starts
    chosen = list(stages or STAGES)
    unknown = [s for s in chosen if s not in STAGE_FLOWS]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages are {', '.join(STAGES)}")
    results: dict[str, Any] = {}
    for name in STAGES:
        if name in chosen:
            log.info("stage %s", name)
            results[name] = STAGE_FLOWS[name](params_file, overrides or [])
    return results

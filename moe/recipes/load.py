"""The params as a recipe run outside the pipeline reads them (`python -m moe.recipes`, the
benchmarks): the recipes' sections of a params file, model.init resolved, and what a torchrun
launch of them needs. Apart from params.py, which the stages' recipes import: resolving
model.init reads the Hugging Face importer, which no stage's training needs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moe.config import ConfigError, Problems
from moe.errors import InputError
from moe.hf.model_init import resolve_init
from moe.recipes.params import ORCHESTRATION, RENAMED_SECTIONS, Params, build_params, read_params


def load_params(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Params:
    """The recipes' sections of `path` (default: ./params.yaml if it exists, else the
    embedded default) with `--set` overrides, model.init resolved; the orchestration's
    sections (storage, pools, cost, ...) are tasks/config.py's to check and are left out.
    Raises ConfigError naming every bad key."""
    raw, lines, source = read_params(path, overrides)
    mine = {f.name for f in dataclasses.fields(Params)} | set(RENAMED_SECTIONS)
    p = Problems(lines, source)
    known = sorted(f.name for f in dataclasses.fields(Params))
    for name in sorted(set(raw) - mine - set(ORCHESTRATION)):
        under = [k for k in p.lines if k.startswith(f"{name}.")]  # a --set names no section line
        p.note(name if name in p.lines or not under else under[0],
               f"{name} is not a section; sections are {', '.join(known)} and the"
               f" pipeline's {', '.join(ORCHESTRATION)}")  # fmt: skip
    params = build_params(Params, {k: v for k, v in raw.items() if k in mine}, p, resolve_init)
    if p.items:
        raise ConfigError(p.items, source)
    return params


def check_world(params: Params, stage: str, world: int) -> None:
    """What `world` processes (torchrun's) need of the stage that the pipeline checks from its
    pools (tasks/config.py): the experts and the batch split evenly, QLoRA and growth alone."""
    sec, moe = getattr(params, stage), params.moe
    groups = sec.expert_parallel or world
    problems = [
        f"moe.num_experts ({moe.num_experts}) does not split over {groups} processes"
        if moe.num_experts % groups or world % groups
        else "",
        f"{stage}.batch_size ({sec.batch_size}) does not split over {world} processes"
        if sec.batch_size % world
        else "",
        f"{stage}.method qlora runs in one process" if sec.method == "qlora" else "",
        "moe.growth runs in one process" if stage == "pretrain" and moe.growth.enabled else "",
    ]
    problems = [x for x in problems if x]
    if problems:
        raise InputError(f"under torchrun with {world} processes: " + "; ".join(problems))

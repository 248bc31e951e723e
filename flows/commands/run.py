"""`moe-pipeline stage` and `moe-pipeline run`: the params and what the stages need checked
before Prefect is imported or anything is touched (bad input is one message and exit 2,
never a flow run's traceback), then the stage flows in this process."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from moe.errors import InputError

if TYPE_CHECKING:
    from tasks.config import Config


# Both validate the params and what the stages need before importing Prefect or touching
# anything: bad input is one message and exit 2, never a flow run's traceback.
def run_stage(args: argparse.Namespace) -> int:
    from tasks.config import load_config

    preflight(load_config(args.params, args.overrides), [args.name])
    _force(args)
    from flows.stages import STAGE_FLOWS

    STAGE_FLOWS[args.name](params_file=args.params, overrides=args.overrides)
    _where(args.name)
    return 0


def run_pipeline(args: argparse.Namespace) -> int:
    from tasks.config import load_config
    from tasks.pools import STAGES

    preflight(load_config(args.params, args.overrides), args.stages or STAGES)
    _force(args)
    from flows.pipeline import pipeline

    pipeline(stages=args.stages, params_file=args.params, overrides=args.overrides)
    _where("evaluate" if not args.stages or "evaluate" in args.stages else args.stages[-1])
    return 0


def _force(args: argparse.Namespace) -> None:
    if args.force:
        os.environ["MOE_FORCE"] = "1"


# What each stage reads that an earlier stage writes (local paths, as dvc.yaml lists them).
def preflight(cfg: Config, stages: list[str] | tuple[str, ...]) -> None:
    """Raise InputError for what the stages need and cannot get: a corpus with no readable
    text, or an upstream output that no stage of this run makes and that is missing or no
    longer matches the hash its stage's lineage record holds."""
    from flows.stage import published_is_prepared
    from flows.stages import STAGES_BY_NAME
    from moe.data.sources import check_source

    if "prepare" in stages:
        d = cfg.data
        check_source(d.source, d.text_field, d.on_bad_record, d.encoding, d.doc_max_bytes)
    for stage in stages:
        for path, producer in STAGES_BY_NAME[stage].reads(cfg):
            if producer in stages:  # made earlier in this run
                continue
            if not path.is_file():
                raise InputError(
                    f"stage {stage} needs {path}, which is missing: run the {producer} stage "
                    f"first (moe-pipeline stage {producer}, or dvc repro)"
                )
            _verify_against_lineage(path, producer, stage)
    readers = [s for s in stages if any(p == "publish" for _, p in STAGES_BY_NAME[s].reads(cfg))]
    published_is_prepared(cfg, readers, stages)


def _verify_against_lineage(path: Path, producer: str, stage: str) -> None:
    """`path` still has the sha256 its producer's lineage record holds (where it has one)."""
    import json

    record = path.parent / "lineage.json"
    if path.suffix != ".safetensors" or not record.is_file():
        return
    try:
        outputs = json.loads(record.read_text()).get("outputs", {})
    except (OSError, ValueError):
        return
    want = next((o["sha256"] for o in outputs.values() if Path(o["path"]) == path), None)
    if want is None:
        return
    from moe.hashing import sha256_file  # a file's hash, as the lineage record took it

    if sha256_file(path) != want:
        raise InputError(
            f"stage {stage} needs {path}, which changed since the {producer} stage wrote it "
            f"(its sha256 no longer matches {record}): run {producer} again "
            f"(moe-pipeline stage {producer} --force) or restore the file (dvc checkout)"
        )


def _where(stage: str) -> None:
    from flows.stages import STAGES_BY_NAME

    print(f"{stage} done: {STAGES_BY_NAME[stage].done}")

"""What every stage shares: its declaration (`Stage`), what its body returns (`Done`), the
project's folders, and what a body may read of the stages before it (their lineage records,
what is left of the budget), handed to it by the wrapper in the `StageRecord`."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe.errors import InputError
from tasks.archive import dataset_version, prepared_output_digest
from tasks.config import Config
from tasks.lineage import StageRecord

log = logging.getLogger("flows.stages")  # by name: a deployment loads flows/stages.py as a script

PUBLISHED = Path("data/published")
MODELS = Path("models")
REPORTS = Path("reports")
EXPORT = MODELS / "export"  # the final model as a Hugging Face folder (evaluate.export_model)


@dataclass
class Done:
    """What a stage's body made. `result` is what the flow returns; `summary` goes to the
    Prefect artifact and `metrics` to the lineage record (both default to `result`)."""

    result: dict[str, Any]
    outputs: dict[str, Path]
    summary: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    wandb_run_id: str | None = None
    compute_s: float | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    section: str  # the params section with its settings
    doc: str  # one line: what it does (the flow's description)
    out: Callable[[Config], Path]  # its folder: lineage.json lands there
    inputs: Callable[[Config], dict[str, Path]]  # content-hashed; raises if one is missing
    handoff: Callable[[Config], list[Path]]  # the files later stages (or the user) read
    body: Callable[[Config, StageRecord], Done]
    done: str  # what `moe-pipeline stage` prints when it is done
    # what it reads that an earlier stage makes: (file, that stage); `moe-pipeline` checks
    # them before a run starts (flows/commands/run.py preflight)
    reads: Callable[[Config], list[tuple[Path, str]]] = field(default=lambda cfg: [])
    trains: bool = False  # a training stage: its model is evaluated and has a cost budget
    # an extra condition for skipping (publish: its objects are still in the store)
    still_there: Callable[[Config], bool] = field(default=lambda cfg: True)


def files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def read_receipt() -> dict[str, Any]:
    path = PUBLISHED / "receipt.json"
    if not path.is_file():
        raise InputError(
            f"{path} is missing: run the publish stage first (moe-pipeline stage publish)"
        )
    return json.loads(path.read_text())


def read_published(cfg: Config) -> dict[str, Any]:
    """The receipt of the published dataset a stage is about to read, refused (before any
    compute) when the prepared data on this machine is not what was published: `prepare`
    ran again (another domain database, other pairs) and publish did not, so the stage
    would train or score on the old data and nothing would say so. The check compares two
    recorded digests, hashing nothing: the one prepare's lineage record gives its output
    and the one publish wrote in the receipt. A machine without prepare's record (a GPU pool
    that only downloads) reads the receipt as it is, and says so."""
    receipt = read_receipt()
    prepared = Path(cfg.data.out_dir)
    recorded = prepared_output_digest(prepared)
    if recorded is None or not (prepared / "meta.json").is_file():
        log.info(
            "%s holds no prepare lineage record here (a worker that downloads the published"
            " data): the check that it is what was published does not apply",
            prepared,
        )
        return receipt
    published = receipt.get("prepared_sha256")
    if published is None:  # a receipt written before publish recorded the digest
        if not (prepared / "tokenizer.json").is_file():  # a hand-off's few files
            log.info("%s predates the recorded digest: the check does not apply", PUBLISHED)
            return receipt
        log.info("%s predates the recorded digest: hashing %s once", PUBLISHED, prepared)
        on_disk, published = dataset_version(prepared), receipt["version"]
    else:
        on_disk = recorded
    if on_disk != published:
        raise InputError(
            f"{prepared} holds data {on_disk[:16]} (its lineage.json) but"
            f" {PUBLISHED / 'receipt.json'} publishes {receipt['name']}/{receipt['version']}"
            f" (data {published[:16]}): prepare ran again and publish did not. Publish it"
            " first (moe-pipeline stage publish, or include publish in `moe-pipeline run"
            " --stages`; dvc repro does it)"
        )
    return receipt


def published_is_prepared(
    cfg: Config, readers: list[str], stages: list[str] | tuple[str, ...]
) -> None:
    """`readers` (of `stages`, one run) read the published data, which must be what
    `prepare` made: a run that prepares again without publishing would train and score on
    the data published before, and one that runs neither must find the prepared data on
    disk as it was published."""
    if not readers or "publish" in stages:
        return
    if "prepare" in stages:
        raise InputError(
            f"--stages runs prepare but not publish, and {', '.join(readers)} read the"
            " published data: they would train or score on the data published before this"
            " prepare. Add publish to --stages (prepare publish ...), or run every stage"
        )
    read_published(cfg)


def published(cfg: Config) -> dict[str, Path]:
    read_published(cfg)  # a missing receipt says which stage to run, a stale one says so
    return {"receipt": PUBLISHED / "receipt.json"}


def train_summary(stage: str, result: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"stage": stage, **asdict(result), **(extra or {})}


def model_handoff(stage: str) -> Callable[[Config], list[Path]]:
    """A training stage's model folder without its checkpoints (they stay on the pool's disk
    and, with checkpoint.offload, in the object store's checkpoint area), and its summary."""

    def handoff(cfg: Config) -> list[Path]:
        models = [p for p in files(MODELS / stage) if "checkpoints" not in p.parts[2:]]
        return [*models, REPORTS / f"{stage}.json"]

    return handoff


def lineage_files(record: StageRecord, missing_ok: bool = False) -> list[Path]:
    """The lineage records of every stage before this one (what the bill sums)."""
    paths = record.upstream
    missing = [str(p) for p in paths if not p.is_file()]
    if missing_ok:
        return [p for p in paths if p.is_file()]
    if missing:
        raise InputError(
            f"lineage records missing: {', '.join(missing)}; run the earlier stages first"
        )
    return paths


def budget_left(cfg: Config, record: StageRecord) -> float:
    """What is left of cost.budget for this stage: the budget minus what the stages before it
    cost by their lineage records (0 = no budget)."""
    if cfg.cost.budget <= 0:
        return 0.0
    spent = 0.0
    for p in lineage_files(record, missing_ok=True):
        spent += float(json.loads(p.read_text()).get("cost", 0.0))
    left = cfg.cost.budget - spent
    if left <= 0:
        log.warning(
            "cost.budget %.4f is already spent (%.4f) before %s",
            cfg.cost.budget,
            spent,
            record.stage,
        )
    return max(left, 1e-9)

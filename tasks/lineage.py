"""Lineage: what each stage ran on and made, and whether it can be skipped.

Every stage writes `lineage.json` beside its outputs (`StageRecord`): input and output content
hashes, the resolved params, the code commit, the Prefect flow-run id, the W&B run id, the
pool and worker, wall time and cost, with a copy in the object store. `up_to_date` reads it
back to decide whether a stage can be skipped, and `lineage_chain` follows the records from
an output back to its corpus (`moe-pipeline lineage`). Secrets never reach a record (`scrub`).
Prepare's record also says what the domain database was (`domain_database`: its URL or
path and its schema-and-row-count fingerprint), against which evaluation checks it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.errors import InputError
from moe.hashing import sha256_file
from tasks.config import Config
from tasks.redact import scrub

log = logging.getLogger(__name__)
# the code that runs: its dvc.yaml names each stage's params and source files, its git the commit
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def write_json(path: Path, data: Any) -> None:
    """Atomic JSON write with secrets scrubbed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(scrub(json.dumps(data, indent=1, sort_keys=True, default=str)) + "\n")
    os.replace(tmp, path)


RECORDS = ("lineage.json", "params.yaml")  # a stage's own records, beside its outputs


def folder_digest(files: dict[str, str]) -> str:
    """The digest of a folder from its files' sha256 (relative path: sha256, in sorted path
    order), its records (RECORDS) left out: what a lineage record says a folder output is."""
    h = hashlib.sha256()
    for rel, sha in files.items():
        if Path(rel).name not in RECORDS:
            h.update(f"{rel}\0{sha}\n".encode())
    return h.hexdigest()


def content_hash(path: Path) -> str:
    """sha256 of a file, or of a folder's (relative path, sha256) list."""
    if path.is_file():
        return sha256_file(path)
    return folder_digest(
        {
            str(p.relative_to(path)): sha256_file(p)
            for p in sorted(path.rglob("*"))
            if p.is_file() and p.name not in RECORDS
        }
    )


def code_version() -> dict[str, Any]:
    """The git commit of the code (and whether moe/tasks/flows differ from it). Where the code
    is a copy without git (an image, a stack worker's folder), MOE_CODE_COMMIT says it."""
    if os.environ.get("MOE_CODE_COMMIT") and not (PACKAGE_ROOT / ".git").exists():
        return {"commit": os.environ["MOE_CODE_COMMIT"], "dirty": None}
    try:  # asked of the package's folder: a project folder of the user's own has no git
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
            cwd=PACKAGE_ROOT,
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "moe", "tasks", "flows"],
                capture_output=True,
                text=True,
                timeout=10,
                cwd=PACKAGE_ROOT,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": commit, "dirty": dirty}


def flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:  # noqa: BLE001 - outside a flow run
        return None


def dvc_file() -> Path | None:
    """The dvc.yaml that lists each stage's params and code: the working folder's (`make
    demo`, `dvc repro`), else the package's own, so a `moe-pipeline run` in a project folder
    of the user's own still compares the code a stage ran (it skipped a stage whose code had
    changed: no dvc.yaml there, nothing compared). None where neither is (an installed wheel)."""
    for path in (Path("dvc.yaml"), PACKAGE_ROOT / "dvc.yaml"):
        if path.is_file():
            return path
    return None


def dvc_stage(stage: str, path: Path | None = None) -> dict[str, Any]:
    """The stage's entry in dvc.yaml (`path`, else `dvc_file`): the one list of the params and
    code each stage reads."""
    import yaml

    path = path or dvc_file()
    if path is None:
        return {}
    return yaml.safe_load(path.read_text()).get("stages", {}).get(stage, {})


def stage_params_hash(cfg: Config, stage: str) -> str:
    """sha256 of the params this stage reads (dvc.yaml's `params` of the stage), so that a
    change to a later stage's params does not invalidate an earlier stage."""
    full = cfg.to_dict()
    picked: dict[str, Any] = {}
    for key in dvc_stage(stage).get("params") or list(full):
        node: Any = full
        for part in str(key).split("."):
            node = node.get(part) if isinstance(node, dict) else None
        picked[str(key)] = node
    if stage == "prepare" and cfg.data.source == "stdlib":
        picked["python"] = platform.python_version()  # the corpus is this Python's stdlib
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()


def code_deps(stage: str) -> dict[str, str]:
    """sha256 of each source file dvc.yaml lists as a dependency of the stage, found beside
    that dvc.yaml or in the package (`PACKAGE_ROOT`)."""
    where = dvc_file()
    if where is None:  # no dvc.yaml: no stage lists its code
        return {}
    out = {}
    bases = [where.parent, PACKAGE_ROOT]
    for dep in dvc_stage(stage, where).get("deps") or []:
        rel = str(dep)
        if not rel.endswith(".py"):
            continue
        found = next((b / rel for b in bases if (b / rel).is_file()), None)
        if found is not None:
            out[str(Path(rel))] = sha256_file(found)
    return out


def up_to_date(
    cfg: Config, stage: str, out_dir: Path, inputs: dict[str, Path], outputs: list[Path]
) -> dict[str, Any] | None:
    """The lineage record of the stage's last run if that run is still valid: same params
    (the stage's), same code, same content hashes of its inputs, outputs present and
    unchanged, and it finished (not cut by a budget). Else None: the stage must run."""
    path = out_dir / "lineage.json"
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except ValueError:
        return None
    if rec.get("stage_params_hash") != stage_params_hash(cfg, stage):
        return None
    if rec.get("code_deps") != code_deps(stage):
        return None
    stop = str(rec.get("metrics", {}).get("stop_reason", ""))
    if "budget" in stop or stop == "stop_after":
        return None
    if not rec.get("outputs") or set(rec.get("inputs", {})) != set(inputs):
        return None
    for name, p in inputs.items():
        if not p.exists() or rec["inputs"][name].get("sha256") != content_hash(p):
            return None
    for o in rec.get("outputs", {}).values():
        p = Path(o["path"])
        if not p.exists() or content_hash(p) != o["sha256"]:
            return None
    if not all(p.exists() for p in outputs):
        return None
    return rec


class StageRecord:
    """Times a stage and writes its lineage record (with its cost) beside its outputs."""

    def __init__(
        self, cfg: Config, stage: str, out_dir: Path, upstream: list[Path] | None = None
    ) -> None:
        """`upstream`: the lineage records of the stages before this one (the budget left,
        the bill)."""
        self.cfg, self.stage, self.out_dir = cfg, stage, out_dir
        self.upstream = upstream or []
        self.pool = cfg.pools.stages[stage]
        spec = cfg.pools.definitions[self.pool]
        self.pricing, self.price_per_hour = spec.pricing, spec.rate * cfg.machines(stage)
        self.t0 = time.time()

    def write(
        self,
        inputs: dict[str, Path],
        outputs: dict[str, Path],
        metrics: dict[str, Any] | None = None,
        wandb_run_id: str | None = None,
        compute_s: float | None = None,
    ) -> dict[str, Any]:
        """Build the record and keep it: lineage.json and params.yaml beside the outputs, a
        copy in the object store, a Prefect artifact."""
        record = self.build(inputs, outputs, metrics, wandb_run_id, compute_s)
        self.cfg.dump(self.out_dir / "params.yaml")
        write_json(self.out_dir / "lineage.json", record)
        self._to_object_store(record)
        from tasks.presentation import lineage_artifact

        lineage_artifact(record)
        return record

    def build(
        self,
        inputs: dict[str, Path],
        outputs: dict[str, Path],
        metrics: dict[str, Any] | None = None,
        wandb_run_id: str | None = None,
        compute_s: float | None = None,
    ) -> dict[str, Any]:
        """The record as of now, written nowhere (evaluate prices itself before it ends)."""
        wall_s = time.time() - self.t0
        res = (metrics or {}).get("resilience") or {}
        if res.get("interruptions"):
            # Attempts lost before this flow run (moe/train/resilience.py): their machines were
            # paid. compute_s is left out: a resumed run's training time includes the kept
            # work of those attempts, already inside their spans.
            lost_attempts_s = sum(
                max(0.0, min(last, self.t0) - start) for start, last in res.get("lost_spans", [])
            )
            billed_s = wall_s + lost_attempts_s
        else:
            lost_attempts_s = 0.0
            billed_s = wall_s if compute_s is None else max(wall_s, compute_s)
        record = {
            "stage": self.stage,
            "inputs": {k: {"path": str(p), "sha256": content_hash(p)} for k, p in inputs.items()},
            "outputs": {k: {"path": str(p), "sha256": content_hash(p)} for k, p in outputs.items()},
            "params": self.cfg.to_dict(),
            "code": code_version(),
            "flow_run_id": flow_run_id(),
            "wandb_run_id": wandb_run_id,
            "pool": self.pool,
            # the Prefect worker that ran it (the local stack names them), and its machine
            "worker": "@".join(filter(None, [os.environ.get("MOE_WORKER"), socket.gethostname()])),
            "params_hash": self.cfg.fingerprint(),
            "stage_params_hash": stage_params_hash(self.cfg, self.stage),
            "code_deps": code_deps(self.stage),
            "price_per_hour": self.price_per_hour,  # x machines for a multi-node stage
            "machines": self.cfg.machines(self.stage),
            "pricing": self.pricing,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.t0)),
            "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": round(wall_s, 3),
            # NOTE: priced at the pool's rate for the time this run took on *this* machine;
            # on the pool's GPU the same stage is faster, so this is an upper bound there.
            "cost": round(billed_s / 3600 * self.price_per_hour, 6),
            "currency": self.cfg.cost.currency,
            "metrics": metrics or {},
        }
        if self.stage == "prepare":
            domain = _domain_database(outputs)
            if domain:
                record["domain_database"] = domain
        if res.get("interruptions"):
            lost = res["interruptions"]
            record["interruptions"] = {
                "count": len(lost),
                "attempts": res["attempts"],
                "steps_lost": res.get("steps_lost", 0),
                "lost_s": res.get("lost_s", 0.0),
                "lost_attempts_s": round(lost_attempts_s, 3),
                "goodput": res.get("goodput", 1.0),
                # what the interruptions cost: machine time paid without progress
                "cost": round(res.get("billed_lost_s", 0.0) / 3600 * self.price_per_hour, 6),
                "each": lost,
            }
            record["wall_s"] = round(wall_s + lost_attempts_s, 3)
        return record

    def _to_object_store(self, record: dict[str, Any]) -> None:
        """A copy of the record in the object store, beside the data (`lineage/<stage>/`), so
        a run's history outlives the machine that ran it."""
        from tasks.storage import open_store

        run = record["flow_run_id"] or "local"
        key = f"lineage/{self.stage}/{record['started'].replace(':', '')}-{run}.json"
        try:
            store = open_store(self.cfg.storage)
            store.put(self.out_dir / "lineage.json", key)
            record["object_store_key"] = f"{store.uri}/{key}"
        except Exception as e:  # noqa: BLE001 - the local record stands; say so
            log.warning(
                "could not copy the %s lineage record to the object store: %s", self.stage, e
            )


def _domain_database(outputs: dict[str, Path]) -> dict[str, Any] | None:
    """What prepare recorded of the domain database (meta.json `sql.domain_database`: where
    it is, never a password, and its schema-and-row-count fingerprint)."""
    for p in outputs.values():
        meta = p / "meta.json"
        if meta.is_file():
            try:
                return json.loads(meta.read_text()).get("sql", {}).get("domain_database")
            except ValueError:
                return None
    return None


# --------------------------------------------------------------------------- the walk back


def lineage_chain(
    root: Path, output: str | Path, warn: Callable[[str], None] = log.warning
) -> list[dict[str, Any]]:
    """Follow lineage records (each stage writes one beside its outputs) from `output` (a
    file or folder under `root`) back to the corpus: which stage made it, from which inputs,
    under which params and code, and whether each file still has the hash the record holds.
    One step per output, depth first; an output met again is a step marked `seen`. An
    unreadable record is skipped with `warn`; an output no record lists is an InputError."""
    producers = _producers(root, warn)
    target = str(output)
    start = _producer_of(producers, target)
    if start is None:
        known = ", ".join(sorted(producers)) or "none (run the pipeline first)"
        raise InputError(
            f"no stage's lineage record lists {target} as an output; known outputs: {known}"
        )
    chain: list[dict[str, Any]] = []
    _visit(root, producers, start[0], start[1], 0, set(), chain)
    return chain


def _producers(root: Path, warn: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Each output the lineage records under `root` list -> the record of its stage."""
    records = []
    for pattern in ("data/*/lineage.json", "models/*/lineage.json", "reports/**/lineage.json"):
        for f in sorted(root.glob(pattern)):
            try:
                records.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                warn(f"{f} is unreadable ({e}); skipped")
    producers: dict[str, dict[str, Any]] = {}
    for r in records:
        for out in r.get("outputs", {}).values():
            producers[str(Path(out["path"]))] = r
    return producers


def _producer_of(
    producers: dict[str, dict[str, Any]], path: str
) -> tuple[str, dict[str, Any]] | None:
    """The output `path` names, else the first output inside the folder `path`, with its
    record."""
    if path in producers:
        return path, producers[path]
    inside = [p for p in producers if p.startswith(path.rstrip("/") + "/")]
    return (inside[0], producers[inside[0]]) if inside else None


def _visit(
    root: Path,
    producers: dict[str, dict[str, Any]],
    path: str,
    rec: dict[str, Any],
    depth: int,
    seen: set[str],
    chain: list[dict[str, Any]],
) -> None:
    if path in seen:
        chain.append({"output": path, "depth": depth, "seen": True})
        return
    seen.add(path)
    chain.append(_step(root, path, rec, depth))
    for inp in rec.get("inputs", {}).values():
        nxt = _producer_of(producers, str(Path(inp["path"])))
        if nxt is not None:
            _visit(root, producers, nxt[0], nxt[1], depth + 1, seen, chain)


def _step(root: Path, path: str, rec: dict[str, Any], depth: int) -> dict[str, Any]:
    """One output of the chain: its record's facts and whether the file still matches."""
    recorded = next(o["sha256"] for o in rec["outputs"].values() if str(Path(o["path"])) == path)
    local = root / path
    now = content_hash(local) if local.exists() else None
    step = {
        "depth": depth,
        "stage": rec.get("stage"),
        "output": path,
        "sha256": recorded,
        "status": "ok" if now == recorded else ("missing" if now is None else "changed since"),
        "inputs": {k: v["path"] for k, v in rec.get("inputs", {}).items()},
        "code": rec.get("code", {}).get("commit"),
        "flow_run_id": rec.get("flow_run_id"),
        "wandb_run_id": rec.get("wandb_run_id"),
        "pool": rec.get("pool"),
        "started": rec.get("started"),
        "wall_s": rec.get("wall_s"),
        "cost": rec.get("cost"),
    }
    if rec.get("stage") == "prepare":
        meta = root / path / "meta.json"
        if meta.is_file():
            m = json.loads(meta.read_text())
            step["corpus"] = {
                "source": m.get("source"),
                "bytes": m.get("source_bytes"),
                "sha256": m.get("source_sha256"),
                "tokenizer_sha256": m.get("tokenizer_sha256"),
            }
    return step

"""Lineage records, the cost ledger, plots and Prefect artifacts.

Every stage writes `lineage.json` beside its outputs: input and output content hashes, the
resolved params, the code commit, the Prefect flow-run id, the W&B run id, the pool, wall time
and cost. The evaluate stage sums those records into the bill (`reports/cost.json`).
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
from pathlib import Path
from typing import Any

from moe.checkpoint import sha256_file
from moe.config import STAGES, Config

log = logging.getLogger(__name__)

SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
)


def scrub(text: str) -> str:
    """Replace the value of any secret environment variable that leaked into `text`."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, f"<{name}>")
    return text


def write_json(path: Path, data: Any) -> None:
    """Atomic JSON write with secrets scrubbed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(scrub(json.dumps(data, indent=1, sort_keys=True, default=str)) + "\n")
    os.replace(tmp, path)


def content_hash(path: Path) -> str:
    """sha256 of a file, or of a folder's (relative path, sha256) list."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name not in ("lineage.json", "params.yaml"):
            h.update(f"{p.relative_to(path)}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def code_version() -> dict[str, Any]:
    """The git commit of the code (and whether moe/tasks/flows differ from it). Where the code
    is a copy without git (an image, a stack worker's folder), MOE_CODE_COMMIT says it."""
    if os.environ.get("MOE_CODE_COMMIT") and not Path(".git").exists():
        return {"commit": os.environ["MOE_CODE_COMMIT"], "dirty": None}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "moe", "tasks", "flows"],
                capture_output=True,
                text=True,
                timeout=10,
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


def _dvc_stage(stage: str) -> dict[str, Any]:
    """The stage's entry in dvc.yaml: the one list of the params and code each stage reads."""
    import yaml

    path = Path("dvc.yaml")
    if not path.is_file():
        return {}
    return yaml.safe_load(path.read_text()).get("stages", {}).get(stage, {})


def stage_params_hash(cfg: Config, stage: str) -> str:
    """sha256 of the params this stage reads (dvc.yaml's `params` of the stage), so that a
    change to a later stage's params does not invalidate an earlier stage."""
    full = cfg.to_dict()
    picked: dict[str, Any] = {}
    for key in _dvc_stage(stage).get("params") or list(full):
        node: Any = full
        for part in str(key).split("."):
            node = node.get(part) if isinstance(node, dict) else None
        picked[str(key)] = node
    if stage == "prepare" and cfg.data.source == "stdlib":
        picked["python"] = platform.python_version()  # the corpus is this Python's stdlib
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()


def code_deps(stage: str) -> dict[str, str]:
    """sha256 of each source file dvc.yaml lists as a dependency of the stage."""
    out = {}
    for dep in _dvc_stage(stage).get("deps") or []:
        p = Path(str(dep))
        if p.suffix == ".py" and p.is_file():
            out[str(p)] = sha256_file(p)
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

    def __init__(self, cfg: Config, stage: str, out_dir: Path) -> None:
        self.cfg, self.stage, self.out_dir = cfg, stage, out_dir
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
        _lineage_artifact(record)
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
            # Attempts lost before this flow run (moe/resilience.py): their machines were
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


def cost_ledger(
    cfg: Config,
    records: list[dict[str, Any]],
    expert_shares: dict[str, list[list[float]] | None] | None = None,
) -> dict[str, Any]:
    """Sum stage records into a bill per stage, per pool and per expert, with a budget check.

    Per expert (seed 002's view): each training stage's cost is split over experts by the
    share of routed tokens each took in that stage, averaged over MoE layers. NOTE: this
    attributes attention and dense compute to experts in proportion too; it answers "which
    experts is the money flowing through", not "what did the expert FLOPs cost".
    """
    by_stage = {
        r["stage"]: {"pool": r["pool"], "wall_s": r["wall_s"], "cost": r["cost"]} for r in records
    }
    for r in records:  # what preemptions cost each stage (included in its cost)
        if r.get("interruptions", {}).get("count"):
            i = r["interruptions"]
            by_stage[r["stage"]].update(
                interruptions=i["count"], interruption_cost=i["cost"], goodput=i["goodput"]
            )
    by_pool: dict[str, float] = {}
    for r in records:
        by_pool[r["pool"]] = round(by_pool.get(r["pool"], 0.0) + r["cost"], 6)
    total = round(sum(r["cost"] for r in records), 6)
    ledger: dict[str, Any] = {
        "currency": cfg.cost.currency,
        "total": total,
        "by_stage": by_stage,
        "by_pool": by_pool,
        "budget": cfg.cost.budget,
    }
    if cfg.cost.budget > 0:
        used = total / cfg.cost.budget
        ledger["budget_used"] = round(used, 4)
        ledger["budget_alert"] = used >= cfg.cost.alert_fraction
        if ledger["budget_alert"]:
            log.warning(
                "spend %.4f %s is %.0f%% of the budget %.2f",
                total,
                cfg.cost.currency,
                100 * used,
                cfg.cost.budget,
            )
    by_expert: dict[str, float] = {}
    for stage, share in (expert_shares or {}).items():
        if not share or stage not in by_stage:
            continue
        for e in range(len(share[0])):
            frac = sum(layer[e] for layer in share) / len(share)
            key = f"expert_{e}"
            by_expert[key] = round(by_expert.get(key, 0.0) + frac * by_stage[stage]["cost"], 6)
    if by_expert:
        ledger["by_expert"] = by_expert
    # The saving of this placement against running every stage on the dearest pool.
    pools = cfg.pools.definitions
    top = max(pools, key=lambda n: pools[n].rate)
    all_top = sum(r["wall_s"] for r in records) / 3600 * pools[top].rate
    ledger["all_on_pool"] = {"pool": top, "cost": round(all_top, 6)}
    ledger["saving"] = round(all_top - total, 6)
    ledger["saving_fraction"] = round(1 - total / all_top, 4) if all_top > 0 else 0.0
    lost = [r["interruptions"] for r in records if r.get("interruptions", {}).get("count")]
    ledger["interruptions"] = {
        "count": sum(i["count"] for i in lost),
        "cost": round(sum(i["cost"] for i in lost), 6),
        "lost_s": round(sum(i["lost_s"] for i in lost), 3),
    }
    return ledger


def phase_costs(rows: list[dict[str, Any]], warmup_steps: int) -> dict[str, float]:
    """Split a training stage's compute cost into seed 002's phases from its metrics rows
    (each logged row carries the cumulative `cost`): warm-up (lr warm-up steps), plateau
    (from the first logged step whose loss is within 2% of the final loss and never leaves
    that band again), and convergence in between."""
    logged = [r for r in rows if "loss" in r and "cost" in r]
    if not logged:
        return {}
    final = logged[-1]["loss"]
    plateau_from = logged[-1]["step"]
    for r in reversed(logged):
        if abs(r["loss"] - final) <= 0.02 * abs(final):
            plateau_from = r["step"]
        else:
            break

    def cost_at(step: int) -> float:
        before = [r["cost"] for r in logged if r["step"] <= step]
        return before[-1] if before else 0.0

    total = logged[-1]["cost"]
    warm = cost_at(warmup_steps)
    plateau_start = max(cost_at(plateau_from), warm)
    return {
        "warm-up": round(warm, 6),
        "convergence": round(plateau_start - warm, 6),
        "plateau": round(total - plateau_start, 6),
        "plateau_from_step": plateau_from,
    }


def storage_costs(cfg: Config, stored_bytes: int, transferred_bytes: int) -> dict[str, float]:
    """A month of storage for what the run keeps, and the transfer it caused, at the
    `cost` section's rates."""
    gb = 1e9
    return {
        "stored_gb": round(stored_bytes / gb, 4),
        "storage_per_month": round(stored_bytes / gb * cfg.cost.storage_per_gb_month, 6),
        "transferred_gb": round(transferred_bytes / gb, 4),
        "transfer": round(transferred_bytes / gb * cfg.cost.egress_per_gb, 6),
    }


def plot_cost(ledger: dict[str, Any], out: Path) -> Path:
    """Bar charts: cost per stage (coloured by pool, with the all-on-the-dearest-pool cost
    beside it), and cost per expert."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {s: i for i, s in enumerate(STAGES)}
    stages = sorted(ledger["by_stage"], key=lambda s: order.get(s, len(order)))
    pools = sorted({v["pool"] for v in ledger["by_stage"].values()})
    colours = {p: plt.get_cmap("tab10")(i) for i, p in enumerate(pools)}
    panels = 2 if ledger.get("by_expert") else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    costs = [ledger["by_stage"][s]["cost"] for s in stages]
    ax.bar(stages, costs, color=[colours[ledger["by_stage"][s]["pool"]] for s in stages])
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colours[p], label=p) for p in pools], fontsize=8)
    ax.set_ylabel(ledger["currency"])
    top = ledger.get("all_on_pool", {})
    ax.set_title(
        f"total {ledger['total']:.4f} (all on {top.get('pool', '?')}: {top.get('cost', 0):.4f})"
    )
    ax.tick_params(axis="x", rotation=30)
    if panels == 2:
        ax2 = axes[0][1]
        experts = list(ledger["by_expert"])
        ax2.bar(
            [e.removeprefix("expert_") for e in experts], [ledger["by_expert"][e] for e in experts]
        )
        ax2.set_xlabel("expert")
        ax2.set_title("training cost by routed tokens")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def publish_cost_table(ledger: dict[str, Any]) -> None:
    """A Prefect table artifact with the bill per stage."""
    try:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(
            key="cost-by-stage",
            table=[
                {
                    "stage": s,
                    "pool": v["pool"],
                    "wall_s": round(v["wall_s"], 1),
                    "cost": v["cost"],
                    "interruptions": v.get("interruptions", 0),
                    "interruption_cost": v.get("interruption_cost", 0.0),
                }
                for s, v in ledger["by_stage"].items()
            ]
            + [
                {
                    "stage": "total",
                    "pool": "",
                    "wall_s": "",
                    "cost": ledger["total"],
                    "interruptions": ledger.get("interruptions", {}).get("count", 0),
                    "interruption_cost": ledger.get("interruptions", {}).get("cost", 0.0),
                }
            ],
            description=f"Cost per stage ({ledger['currency']}); saving against all on "
            f"{ledger.get('all_on_pool', {}).get('pool', '?')}: {ledger.get('saving')}",
        )
    except Exception as e:  # noqa: BLE001 - an artifact must never fail a stage
        log.warning("could not create the cost table artifact: %s", e)


def _lineage_artifact(record: dict[str, Any]) -> None:
    """The lineage record as a Prefect artifact on the stage's flow run (the UI's lineage
    view): hashes, params hash, commit, runs, pool, worker, times, cost."""
    try:
        from prefect.artifacts import create_markdown_artifact

        if not record.get("flow_run_id"):
            return
        rows = [
            *(
                f"| input {k} | `{v['path']}` | `{v['sha256'][:16]}` |"
                for k, v in record["inputs"].items()
            ),
            *(
                f"| output {k} | `{v['path']}` | `{v['sha256'][:16]}` |"
                for k, v in record["outputs"].items()
            ),
        ]
        facts = {
            "params hash": record["params_hash"][:16],
            "code": record["code"]["commit"][:12],
            "W&B run": record.get("wandb_run_id"),
            "pool / worker": f"{record['pool']} / {record['worker']}",
            "start / end": f"{record['started']} / {record['ended']}",
            "wall s": record["wall_s"],
            "cost": f"{record['cost']} {record['currency']}",
            "object store copy": record.get("object_store_key"),
        }
        md = (
            f"# Lineage of {record['stage']}\n\n| | path | sha256 |\n|---|---|---|\n"
            + "\n".join(rows)
            + "\n\n| field | value |\n|---|---|\n"
            + "\n".join(f"| {k} | {v} |" for k, v in facts.items())
            + "\n"
        )
        create_markdown_artifact(
            key=f"{record['stage'].replace('_', '-')}-lineage",
            markdown=scrub(md),
            description=f"Lineage record of the {record['stage']} stage",
        )
    except Exception as e:  # noqa: BLE001 - an artifact must never fail a stage
        log.warning("could not create the lineage artifact of %s: %s", record.get("stage"), e)


def publish_artifacts(stage: str, summary: dict[str, Any]) -> None:
    """A Prefect markdown artifact with the stage summary (visible in the UI)."""
    try:
        from prefect.artifacts import create_markdown_artifact

        rows = "\n".join(
            f"| {k} | {v} |" for k, v in summary.items() if not isinstance(v, (dict, list))
        )
        create_markdown_artifact(
            key=f"{stage.replace('_', '-')}-summary",
            markdown=scrub(f"# {stage}\n\n| field | value |\n|---|---|\n{rows}\n"),
            description=f"Summary of the {stage} stage",
        )
    except Exception as e:  # noqa: BLE001 - an artifact must never fail a stage
        log.warning("could not create the Prefect artifact for %s: %s", stage, e)


def plot_training(metrics_files: dict[str, Path], out: Path) -> Path | None:
    """Loss curves of every training stage in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(metrics_files), figsize=(5 * len(metrics_files), 3.5), squeeze=False
    )
    drawn = False
    for ax, (stage, path) in zip(axes[0], metrics_files.items(), strict=True):
        if not path.is_file():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), label="train")
            drawn = True
        if val:
            ax.plot(*zip(*val, strict=True), "o-", label="val")
        ax.set_title(stage)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    if not drawn:
        plt.close(fig)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_expert_load(metrics_file: Path, out: Path, title: str) -> Path | None:
    """Heatmap of the share of routed tokens per expert (x) over logged steps (y), one panel
    per MoE layer. A balanced router is a flat colour; a collapsing one shows bright columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not metrics_file.is_file():
        return None
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    rows = [r for r in rows if r.get("expert_share")]
    if not rows:
        return None
    share_SLE = np.array([r["expert_share"] for r in rows])  # (steps, layers, experts)
    steps = [r["step"] for r in rows]
    n_layers, n_experts = share_SLE.shape[1], share_SLE.shape[2]
    fig, axes = plt.subplots(1, n_layers, figsize=(3 + 2.5 * n_layers, 4), squeeze=False)
    for layer, ax in enumerate(axes[0]):
        im = ax.imshow(
            share_SLE[:, layer, :],
            aspect="auto",
            cmap="viridis",
            vmin=0,
            vmax=max(2.0 / n_experts, float(share_SLE.max())),
            extent=(-0.5, n_experts - 0.5, steps[-1], steps[0]),
        )
        ax.set_title(f"{title}: MoE layer {layer}")
        ax.set_xlabel("expert")
        ax.set_ylabel("step")
    fig.colorbar(im, ax=axes[0].tolist(), label="share of routed tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

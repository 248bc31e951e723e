"""What a person reads: plots, Prefect artifacts and the run's markdown report.

Nothing here may fail a stage: an artifact that cannot be created (outside a flow run, the
API away) is a warning in the log (`safe_artifact`), and a plot with nothing to draw is
skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.model_scores import model_lines
from tasks.pools import STAGES
from tasks.redact import scrub

log = logging.getLogger(__name__)


def safe_artifact(what: str, create: Callable[[], Any]) -> None:
    """Run `create`, which builds and makes one Prefect artifact; a failure (outside a flow
    run, the API away, a record missing a field) is logged, never raised."""
    try:
        create()
    except Exception as e:  # noqa: BLE001 - an artifact must never fail a stage
        log.warning("could not create the %s artifact: %s", what, e)


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
    safe_artifact("cost table", lambda: _cost_table(ledger))


def _cost_table(ledger: dict[str, Any]) -> None:
    from prefect.artifacts import create_table_artifact

    interruptions = ledger.get("interruptions", {})
    table = [
        {
            "stage": s,
            "pool": v["pool"],
            "wall_s": round(v["wall_s"], 1),
            "cost": v["cost"],
            "interruptions": v.get("interruptions", 0),
            "interruption_cost": v.get("interruption_cost", 0.0),
        }
        for s, v in ledger["by_stage"].items()
    ] + [
        {
            "stage": "total",
            "pool": "",
            "wall_s": "",
            "cost": ledger["total"],
            "interruptions": interruptions.get("count", 0),
            "interruption_cost": interruptions.get("cost", 0.0),
        }
    ]
    description = (
        f"Cost per stage ({ledger['currency']}); saving against all on "
        f"{ledger.get('all_on_pool', {}).get('pool', '?')}: {ledger.get('saving')}"
    )
    create_table_artifact(key="cost-by-stage", table=table, description=description)


def lineage_artifact(record: dict[str, Any]) -> None:
    """The lineage record as a Prefect artifact on the stage's flow run (the UI's lineage
    view): hashes, params hash, commit, runs, pool, worker, times, cost."""
    if record.get("flow_run_id"):
        safe_artifact(f"{record.get('stage')} lineage", lambda: _lineage_markdown(record))


def _lineage_markdown(record: dict[str, Any]) -> None:
    from prefect.artifacts import create_markdown_artifact

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


def publish_artifacts(stage: str, summary: dict[str, Any]) -> None:
    """A Prefect markdown artifact with the stage summary (visible in the UI)."""
    safe_artifact(f"{stage} summary", lambda: _summary_markdown(stage, summary))


def _summary_markdown(stage: str, summary: dict[str, Any]) -> None:
    from prefect.artifacts import create_markdown_artifact

    rows = "\n".join(
        f"| {k} | {v} |" for k, v in summary.items() if not isinstance(v, (dict, list))
    )
    create_markdown_artifact(
        key=f"{stage.replace('_', '-')}-summary",
        markdown=scrub(f"# {stage}\n\n| field | value |\n|---|---|\n{rows}\n"),
        description=f"Summary of the {stage} stage",
    )


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


def _bill_lines(ledger: dict[str, Any]) -> list[str]:
    """The report's bill: per stage, and the total with what interruptions cost."""
    return [
        "| stage | pool | wall s | cost | interruptions (cost, goodput) |",
        "|---|---|---|---|---|",
        *(
            f"| {s} | {v['pool']} | {v['wall_s']:.1f} | {v['cost']:.5f} | "
            + (
                f"{v['interruptions']} ({v['interruption_cost']:.5f}, {v['goodput']:.0%})"
                if v.get("interruptions")
                else "none"
            )
            + " |"
            for s, v in ledger["by_stage"].items()
        ),
        "",
        f"Total {ledger['total']:.5f} {ledger['currency']}"
        + (
            f", of which {ledger['interruptions']['cost']:.5f} paid for work lost to "
            f"{ledger['interruptions']['count']} interruption(s)"
            if ledger.get("interruptions", {}).get("count")
            else ""
        ),
    ]


def run_report(
    path: Path,
    receipt: dict[str, Any],
    commit: str,
    metrics: dict[str, Any],
    ledger: dict[str, Any],
    cost_png: Path,
    plot: Path | None,
    heatmaps: list[Path | None],
) -> Path:
    """The run's markdown report (reports/evaluate/report.md): the bill per stage, every
    stage's model on the held-out sets (per kind of query too), samples, the saving against
    running everything on the dearest pool, and the plots."""
    trained = [s for s in STAGES if s in metrics]  # the training stages, in order
    lines = [
        "# Run report",
        "",
        f"Dataset {receipt['name']}/{receipt['version']}, code {commit[:12]}",
        "",
        *_bill_lines(ledger),
        *model_lines(metrics, trained),
    ]
    lines += [
        "",
        f"Against every stage on {ledger['all_on_pool']['pool']}: "
        f"{ledger['all_on_pool']['cost']:.5f}, a saving of {ledger['saving']:.5f} "
        f"({ledger['saving_fraction']:.0%}).",
        "",
        f"![cost]({cost_png.name})",
    ]
    if plot:
        lines += ["", f"![training loss]({plot.name})"]
    lines += [f"![expert load]({h.name})" for h in heatmaps if h]
    path.write_text("\n".join(lines) + "\n")
    return path


PIPELINE_REPORT = "moe-pipeline-report"  # the artifact key of the pipeline run's last word


def pipeline_markdown(
    metrics: dict[str, Any], ledger: dict[str, Any], runs: dict[str, str], ui_url: str | None
) -> str:
    """The pipeline run's results in one page: per trained stage its perplexity and execution
    accuracy on each kind of held-out question, the bill per stage and pool with what it
    saved against one pool, the interruptions, and a link to each stage's flow run."""
    cur = ledger.get("currency", "USD")
    kinds = [
        ("sql", "domain"),
        ("generic_seen", "generic, training DBs"),
        ("generic_heldout", "generic, held-out DBs"),
    ]
    trained = [s for s in STAGES if isinstance(metrics.get(s), dict) and "val" in metrics[s]]
    present = [(k, label) for k, label in kinds if any(k in metrics[s] for s in trained)]
    head = "| stage | perplexity | " + " | ".join(f"exec acc ({lb})" for _, lb in present) + " |"
    lines = ["# moe-pipeline run", "", "## Results", "", head]
    lines.append("|---" * (2 + len(present)) + "|")
    for s in trained:
        accs = [
            f"{metrics[s][k]['execution_accuracy']:.3f} ({metrics[s][k]['examples']})"
            if k in metrics[s]
            else "-"
            for k, _ in present
        ]
        lines.append(f"| {s} | {metrics[s]['val']['perplexity']:.2f} | " + " | ".join(accs) + " |")
    lines += ["", f"## The bill ({cur})", "", "| stage | pool | wall s | cost | interruptions |"]
    lines.append("|---|---|---|---|---|")
    order = {s: i for i, s in enumerate(STAGES)}
    for s in sorted(ledger["by_stage"], key=lambda s: order.get(s, len(order))):
        v = ledger["by_stage"][s]
        lines.append(
            f"| {s} | {v['pool']} | {v['wall_s']:.1f} | {v['cost']:.5f} | "
            f"{v.get('interruptions', 0)} |"
        )
    lines.append(f"| **total** | | | **{ledger['total']:.5f}** | |")
    lines += ["", "| pool | cost |", "|---|---|"]
    lines += [f"| {p} | {c:.5f} |" for p, c in sorted(ledger["by_pool"].items())]
    top = ledger.get("all_on_pool") or {}
    if top:
        lines += [
            "",
            f"Every stage on {top['pool']} would have cost {top['cost']:.5f} {cur}: this run "
            f"saved {ledger['saving']:.5f} ({100 * ledger['saving_fraction']:.1f}%).",
        ]
    lost = ledger.get("interruptions") or {}
    lines += [
        "",
        "## Interruptions",
        "",
        f"{lost.get('count', 0)} machine(s) lost, {lost.get('lost_s', 0.0):.1f} s of work "
        f"redone, costing {lost.get('cost', 0.0):.5f} {cur}."
        if lost.get("count")
        else "No machine was lost.",
        "",
        "## Stage runs",
        "",
    ]
    for s, run_id in runs.items():
        link = f"{ui_url.rstrip('/')}/runs/flow-run/{run_id}" if ui_url else None
        lines.append(f"- {s}: [{run_id}]({link})" if link else f"- {s}: {run_id}")
    return scrub("\n".join(lines) + "\n")


def publish_pipeline_report(
    metrics_path: Path, cost_path: Path, runs: dict[str, str]
) -> str | None:
    """The pipeline run's markdown artifact (`pipeline_markdown`), from the evaluate stage's
    reports; returns the markdown, or None when the reports are not there."""
    if not (metrics_path.is_file() and cost_path.is_file()):
        return None
    from prefect.settings import PREFECT_UI_URL

    metrics = json.loads(metrics_path.read_text())
    ledger = json.loads(cost_path.read_text())
    text = pipeline_markdown(metrics, ledger, runs, PREFECT_UI_URL.value())

    def create() -> None:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(
            key=PIPELINE_REPORT,
            markdown=text,
            description="The pipeline run: results, the bill, interruptions, the stage runs",
        )

    safe_artifact("pipeline report", create)
    return text

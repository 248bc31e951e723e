"""Every ML claim of the finetuning recipe, measured: arms at equal total finetuning steps,
several seeds each, mean and spread.

    .venv/bin/python bench/finetune_ablation.py [--seeds 1337 1338 1339] [--arms ...]
                                                [--work DIR] [--set KEY=VALUE ...]

For each seed, a scratch project under --work runs prepare, publish and pretrain with
`pretrain.seed` (and the finetune seeds) set to it, through `moe-pipeline run`, exactly as the
demo does. Then each arm finetunes from that pretrained model (or from a random one) with the
same code the finetune stages run (moe/recipes/finetune.py) and is scored on the held-out sets:

  two_stage     the default: generic SQL pairs (finetune_sql.max_steps), then the domain
                pairs (finetune_domain.max_steps)
  domain_only   the domain pairs only, for the sum of both stages' steps
  generic_only  the generic pairs only, for the sum of both stages' steps
  no_focus      two_stage with focus-token weighting off (focus_weight 1.0)
  no_replay     two_stage without replay rows (replay_ratio 0)
  random_init   two_stage from an untrained model (does pretraining help?)

Columns: domain execution accuracy (200 held-out domain questions), generic execution
accuracy (200 generic questions never trained on; half on training databases, half on
held-out schemas), validation perplexity on held-out pretraining text. Prints a table and,
last, one JSON line with every figure per seed. Each arm costs ~5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tasks  # noqa: E402

tasks.offline_defaults()
from moe.sql.generator import KINDS  # noqa: E402
from tasks.config import load_config  # noqa: E402

ARMS = ("two_stage", "domain_only", "generic_only", "no_focus", "no_replay", "random_init")


def pretrain(seed: int, work: Path, overrides: list[str]) -> Path:
    """A scratch project with prepared data and a pretrained model for `seed`."""
    project = work / f"seed-{seed}"
    project.mkdir(parents=True, exist_ok=True)
    (project / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    sets = [
        *overrides,
        *(f"{s}.seed={seed}" for s in ("pretrain", "finetune_sql", "finetune_domain")),
    ]
    cmd = [sys.executable, "-m", "flows.cli", "run", "--stages", "prepare", "publish", "pretrain"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"pretraining seed {seed} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return project


def run_arm(arm: str, seed: int, project: Path, overrides: list[str]) -> dict[str, float]:
    from moe.hf.model_dir import load_model_dir, save_stage_model
    from tasks.finetuning import finetune_model

    base = load_config(None, overrides)
    steps = base.finetune_sql.max_steps + base.finetune_domain.max_steps
    extra = [f"{s}.seed={seed}" for s in ("pretrain", "finetune_sql", "finetune_domain")]
    if arm == "no_focus":
        extra += ["finetune_sql.focus_weight=1.0", "finetune_domain.focus_weight=1.0"]
    if arm == "no_replay":
        extra += ["finetune_sql.replay_ratio=0", "finetune_domain.replay_ratio=0"]
    if arm == "domain_only":
        extra += [f"finetune_domain.max_steps={steps}"]
    if arm == "generic_only":
        extra += [f"finetune_sql.max_steps={steps}"]
    cfg = load_config(None, [*overrides, *extra])
    data = project / "data/prepared"
    out = project / "arms" / arm
    init = project / "models/pretrain"
    if arm == "random_init":
        import torch

        model = load_model_dir(init, torch.float32)
        torch.manual_seed(seed)
        model.reset_parameters()
        init = out / "random_init"
        save_stage_model(model, init)
    t0 = time.perf_counter()

    def finetune(stage: str, pairs: str, start: Path) -> Path:
        finetune_model.fn(cfg, stage, data, pairs, start, out / stage, lambda r: None)
        return out / stage

    if arm == "domain_only":
        final = finetune("finetune_domain", "domain_train.jsonl", init)
    elif arm == "generic_only":
        final = finetune("finetune_sql", "generic.jsonl", init)
    else:
        middle = finetune("finetune_sql", "generic.jsonl", init)
        final = finetune("finetune_domain", "domain_train.jsonl", middle)
    seconds = time.perf_counter() - t0
    out_row = {**score(cfg, data, final), "seconds": seconds}
    if arm not in ("domain_only", "generic_only"):  # the model after the SQL stage, too
        out_row.update({f"sql_stage_{k}": v for k, v in score(cfg, data, middle).items()})
    return out_row


def score(cfg: object, data: Path, model_dir: Path) -> dict[str, float]:
    from tasks.evaluation import evaluate_perplexity, evaluate_sql

    sql = evaluate_sql.fn(cfg, data, model_dir)
    generic = [sql[k] for k in ("generic_seen", "generic_heldout")]
    n = sum(g["examples"] for g in generic)
    return {
        "domain_exec": sql["sql"]["execution_accuracy"],
        "domain_valid": sql["sql"]["valid_sql"],
        "generic_exec": sum(g["execution_accuracy"] * g["examples"] for g in generic) / n,
        "generic_seen_exec": sql["generic_seen"]["execution_accuracy"],
        "generic_heldout_exec": sql["generic_heldout"]["execution_accuracy"],
        "ppl": evaluate_perplexity.fn(cfg, data, model_dir)["perplexity"],
        **{
            f"domain_{kind}": v["execution_accuracy"]
            for kind, v in sql["sql"]["by_template"].items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--work", type=Path, default=Path(".cache/finetune-ablation"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    work = a.work.resolve()
    results: dict[str, dict[int, dict[str, float]]] = {arm: {} for arm in a.arms}
    for seed in a.seeds:
        project = pretrain(seed, work, a.overrides)
        pre = score(
            load_config(None, a.overrides), project / "data/prepared", project / "models/pretrain"
        )
        results.setdefault("pretrained", {})[seed] = pre
        print(
            f"seed {seed}: pretrained: domain {pre['domain_exec']:.3f}  generic "
            f"{pre['generic_exec']:.3f}  ppl {pre['ppl']:.1f}",
            flush=True,
        )
        for arm in a.arms:  # arms interleaved within each seed: the machine's drift hits all
            results[arm][seed] = r = run_arm(arm, seed, project, a.overrides)
            print(
                f"  {arm:13s} domain {r['domain_exec']:.3f}  generic {r['generic_exec']:.3f}"
                f"  ppl {r['ppl']:.1f}  ({r['seconds']:.0f} s)",
                flush=True,
            )

    def cell(arm: str, key: str, fmt: str) -> str:
        vals = [r[key] for r in results[arm].values()]
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        return f"{format(statistics.mean(vals), fmt)} ± {format(sd, fmt)}"

    print(f"\n{len(a.seeds)} seeds: mean ± standard deviation")
    print("| arm | domain exec. acc. | generic exec. acc. (never trained on) | val perplexity |")
    print("|---|---|---|---|")
    for arm in ["pretrained", *a.arms]:
        print(
            f"| {arm} | {cell(arm, 'domain_exec', '.3f')} | {cell(arm, 'generic_exec', '.3f')}"
            f" | {cell(arm, 'ppl', '.1f')} |"
        )
    if any("sql_stage_generic_exec" in r for arm in a.arms for r in results[arm].values()):
        print("\nafter the SQL stage (finetune_sql) of the two-stage arms:")
        print("| arm | domain exec. acc. | generic exec. acc. | val perplexity |")
        print("|---|---|---|---|")
        for arm in a.arms:
            if all("sql_stage_generic_exec" in r for r in results[arm].values()):
                print(
                    f"| {arm} | {cell(arm, 'sql_stage_domain_exec', '.3f')}"
                    f" | {cell(arm, 'sql_stage_generic_exec', '.3f')}"
                    f" | {cell(arm, 'sql_stage_ppl', '.1f')} |"
                )
    kinds = [
        k for k in KINDS if all(f"domain_{k}" in r for r in results.get("two_stage", {}).values())
    ]
    if results.get("two_stage") and kinds:
        print("\ndomain execution accuracy per kind of question, two_stage:")
        print("| kind | execution accuracy | per seed |")
        print("|---|---|---|")
        for k in kinds:
            per = ", ".join(f"{r[f'domain_{k}']:.2f}" for r in results["two_stage"].values())
            print(f"| {k} | {cell('two_stage', f'domain_{k}', '.3f')} | {per} |")
    print(json.dumps({"seeds": a.seeds, "results": results}))


if __name__ == "__main__":
    main()

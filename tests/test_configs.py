"""Contract of the recipes (configs/): one params file per model and method that a user copies.
Each says in its opening comment what it is for, the machine it is sized for and what `plan`
says it needs; each passes `params check` and `plan` places each of its training stages on a
pool that fits, with the real model's published config.json (tests/fixtures/models: numbers,
no weights); and one recipe per method (full, LoRA, QLoRA) runs the whole pipeline on a tiny
model of its family with sizes shrunk by --set alone."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import cli_env, pipeline_cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
FIXTURES = ROOT / "tests" / "fixtures" / "models"
IDS = [r.stem for r in RECIPES]


def _recipe(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's project as the recipes expect it: models/hf/<Name> with the real config.json
    (and a tokenizer of ours: only its file is checked here), data/spider present."""
    from tests.hf_fixture import make_tokenizer

    root = tmp_path_factory.mktemp("recipes")
    tok = root / "tok"
    tok.mkdir()
    make_tokenizer(tok, vocab=512)
    for folder in FIXTURES.iterdir():
        if folder.is_dir():
            dest = root / "models" / "hf" / folder.name
            shutil.copytree(tok, dest)
            shutil.copy(folder / "config.json", dest / "config.json")
    (root / "data" / "spider").mkdir(parents=True)
    return root


def test_there_is_a_recipe_per_model_and_method() -> None:
    methods = {
        (_recipe(r)["model"]["init"], _recipe(r)["finetune_sql"].get("method", "full"))
        for r in RECIPES
    }
    names = {Path(init).name for init, _ in methods}
    assert {
        "SmolLM2-135M-Instruct",
        "Qwen3-30B-A3B",
        "gpt-oss-20b",
        "OLMoE-1B-7B-0924",
        "Mixtral-8x7B-v0.1",
        "Qwen2.5-Coder-0.5B-Instruct",
    } <= names
    assert {m for _, m in methods} == {"full", "lora", "qlora"}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_recipe_says_what_it_is_for_where_it_fits_and_its_model(recipe: Path) -> None:
    head = [line for line in recipe.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(head)
    assert head[0].startswith("# ") and "text-to-SQL" in head[0], "what it is for, first"
    assert re.search(r"^# (GPU|Machine): ", text, re.M), "the machine it is sized for"
    assert f"# Plan (moe-pipeline plan --params configs/{recipe.name}):" in text
    init = _recipe(recipe)["model"]["init"]
    assert (FIXTURES / Path(init).name / "config.json").is_file(), "its model's config.json"
    assert f"--local-dir {init}" in " ".join(h.lstrip("# ") for h in head), "how to get it"


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_every_recipe_passes_params_check(recipe: Path, project: Path) -> None:
    r = pipeline_cli(["params", "check", "--params", str(recipe)], project)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("OK")


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_plan_places_each_stage_on_a_pool_that_fits(recipe: Path, project: Path) -> None:
    """`plan` exits 0 (no stage refused), each finetune is on the recipe's pool with its
    method marked and that pool's line says "fits"; the memory the recipe's comment quotes is
    what plan prints (a recipe edited without its comment fails here)."""
    r = pipeline_cli(["plan", "--params", str(recipe)], project)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = _recipe(recipe)
    quoted = re.findall(r"([\d.]+) GB on one GPU", recipe.read_text())
    for stage in ("finetune_sql", "finetune_domain"):
        pool = cfg["pools"]["stages"][stage]
        method = cfg[stage].get("method", "full")
        block = r.stdout.split(f"{stage}: pool {pool}, method {method}\n")[1]
        mine = re.split(r"\n(?=    \S|\S)", block.split(f"  * {method}")[1])[0]
        rows = mine.split("\n")
        gb = re.search(r"= +([\d.]+) GB on one GPU", rows[0]).group(1)
        if pool != "cpu":
            assert any(re.match(rf"\s+{pool}\s+\d+ GPU\(s\) fits", row) for row in rows), mine
            assert any(abs(float(gb) - float(q)) <= 0.051 for q in quoted), (gb, quoted)
    if cfg["model"].get("init_pretrain") == "skip":
        assert "pretrain: skipped" in r.stdout


# One recipe per method, on a tiny model of its family made by transformers here: its sizes
# shrunk by --set alone (the recipe file itself is used as it is).
SHRINK = [
    "data.sql_generic_source=generated",
    # SmolLM2's recipe generates 2,000 pairs beside Spider's; the embedded default's source
    # is all generated
    "data.sql_generic_generated=0",
    "data.max_bytes=300000",
    "data.sql_generic_pairs=120",
    "data.sql_generic_test_pairs=10",
    "data.sql_domain_train_pairs=30",
    "data.sql_domain_test_pairs=6",
    "model.seq_len=512",
    "pretrain.eval_batches=1",
    "evaluate.max_examples=3",
    "evaluate.max_new_tokens=96",  # room for a domain test pair's SQL in the tiny tokenizer
    "evaluate.val_batches=1",
    "evaluate.batch_size=4",
    "wandb.mode=disabled",
    *(f"pools.stages.{s}=cpu" for s in ("pretrain", "finetune_sql", "finetune_domain", "evaluate")),
    *(
        f"{s}.{k}"
        for s in ("finetune_sql", "finetune_domain")
        for k in (
            "max_steps=2",
            "batch_size=4",
            "grad_accum=1",
            "max_len=480",
            "warmup_steps=1",
            "checkpoint_every=2",
            "log_every=1",
            "device=cpu",
            "dtype=float32",
        )
    ),
    "pretrain.device=cpu",
    "evaluate.device=cpu",
]
TINY = {  # recipe: (the transformers config class, its family's fields)
    "smollm2-135m-sql-cpu": ("LlamaConfig", {"tie_word_embeddings": True}),
    "olmoe-1b-7b-lora-24gb": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-30b-a3b-qlora-48gb": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_a_recipe_runs_the_pipeline_on_a_tiny_model_of_its_family(
    name: str, tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    import torch
    import transformers

    from tests.hf_fixture import make_tokenizer

    recipe = ROOT / "configs" / f"{name}.yaml"
    model = tmp_path / "tiny"
    vocab = make_tokenizer(model)
    cls, extra = TINY[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        **extra,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model)
    sets = [f"model.init={model}", *SHRINK]
    args = ["run", "--params", str(recipe)]
    for s in sets:
        args += ["--set", s]
    r = pipeline_cli(args, tmp_path, cli_env(prefect_server))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    method = _recipe(recipe)["finetune_sql"].get("method", "full")
    summary = yaml.safe_load((tmp_path / "reports" / "summary.json").read_text())
    assert summary  # evaluate wrote its headline
    resolved = yaml.safe_load((tmp_path / "models" / "finetune_sql" / "params.yaml").read_text())
    assert resolved["finetune_sql"]["method"] == method
    assert resolved["finetune_sql"]["lr"] == _recipe(recipe)["finetune_sql"]["lr"]
    if method != "full":
        assert (tmp_path / "models" / "finetune_sql" / "adapter.safetensors").is_file()

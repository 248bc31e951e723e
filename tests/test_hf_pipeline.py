"""The whole pipeline from a model a user brings (model.init): transformers' own Qwen3-MoE with
a tokenizer that is not ours (tests/hf_fixture.py; 66,000 tokens, so prepare writes uint32
token files), continued-pretrained, finetuned twice, evaluated, then exported with
`moe-pipeline model export` and loaded back by transformers, and asked a question. The
domain stage trains LoRA adapters: its folder holds the merged model and the adapters, and
the export adds a PEFT folder that PEFT loads."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import cli_env, merge, pipeline_cli, tiny_params
from tests.hf_fixture import make_qwen3_moe, make_tokenizer
from tests.test_e2e import _copy_repo

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ran(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]
) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("hfrepo")
    _copy_repo(root)
    vocab = make_tokenizer(root / "hf_model", extra=65_000)  # 66,024 > 65,535
    make_qwen3_moe(root / "hf_model", vocab)
    params = merge(yaml.safe_load((root / "params.yaml").read_text()), tiny_params())
    params["model"]["init"] = "hf_model"
    params["pretrain"]["lr"] = 3e-4  # continued pretraining: a small rate
    for stage in ("pretrain", "finetune_sql", "finetune_domain"):
        params[stage]["batch_size"] = 4  # 66k-entry logits
    # a second a step (66k-entry logits): what the tests read needs a few steps and a save
    params["pretrain"].update(max_steps=4, checkpoint_every=2, eval_every=4, log_every=2)
    for stage in ("finetune_sql", "finetune_domain"):
        params[stage].update(max_steps=3, checkpoint_every=3, log_every=1)
    # the domain stage trains LoRA adapters on the finetune_sql model (a user's usual choice)
    params["finetune_domain"]["method"] = "lora"
    params["finetune_domain"]["lora"]["rank"] = 4
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = cli_env(prefect_server, root)
    cli(root, env, "run")
    return root, env


def cli(
    root: Path, env: dict[str, str], *args: str, ok: bool = True
) -> subprocess.CompletedProcess:
    r = pipeline_cli(list(args), root, env)
    if ok:
        assert r.returncode == 0, f"{args}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_prepare_uses_the_models_own_tokenizer(ran: tuple[Path, dict[str, str]]) -> None:
    root, _ = ran
    meta = json.loads((root / "data/prepared/meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65_535
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "hf_model/tokenizer.json"))
    assert meta["eot_id"] == tok.token_to_id("</s>")  # read from tokenizer_config.json
    # An SFT example: bos once, in front; the tokenizer's post-processor adds none inside.
    from moe.data.tokenizer import specials
    from moe.recipes.finetune import sft_examples

    sp = specials(tok, root / "data/prepared/tokenizer.json")
    ex = sft_examples(root / "data/prepared/sql/domain_train.jsonl", tok, sp)[0]
    bos = tok.token_to_id("<s>")
    assert ex.prompt[0] == bos and bos not in ex.prompt[1:] and bos not in ex.response
    assert ex.response[-1] == sp.eos


def test_training_started_from_the_imported_weights(ran: tuple[Path, dict[str, str]]) -> None:
    root, _ = ran
    spec = json.loads((root / "models/pretrain/model.json").read_text())
    assert spec["model"]["qk_norm"] == "head" and spec["model"]["n_kv_head"] == 2
    assert "aux_free" not in spec["moe"]["balancing"]  # Qwen3-MoE has no selection bias
    record = json.loads((root / "models/pretrain/lineage.json").read_text())
    assert record["inputs"]["init"]["path"] == "hf_model" and record["inputs"]["init"]["sha256"]
    # The pretrain loss started near the imported model's (random weights over 66k tokens:
    # ln 66032 = 11.1), not where a fresh init of another shape would.
    rows = [
        json.loads(x)
        for x in (root / "models/pretrain/metrics.jsonl").read_text().splitlines()
        if x
    ]
    first = next(r for r in rows if "loss" in r)
    assert 10.0 < first["loss"] < 12.5


def test_the_finetuned_model_exports_to_what_transformers_loads(
    ran: tuple[Path, dict[str, str]],
) -> None:
    root, env = ran
    out = cli(root, env, "model", "export", "models/finetune_domain", "--out", "export")
    assert "Qwen3MoeForCausalLM" in out.stdout
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        root / "export", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    from moe.hf.model_dir import load_model_dir

    ours = load_model_dir(root / "models/finetune_domain", dtype=torch.float32).eval()
    idx = torch.randint(0, 66_000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((ours(idx)[0] - hf.eval()(idx).logits).abs().max()) < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(root / "export")
    assert tok.eos_token == "</s>"
    # transformers' greedy generate on the export writes the tokens our model writes (what
    # `ask` and evaluate decode with: generate_batch, a KV cache), to its end token
    prompt = idx[0, :10].tolist()
    mine = ours.generate_batch([prompt], 16, {tok.eos_token_id})[0]
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert len(mine) > 1 and theirs[: len(mine)] == mine, (mine, theirs)
    card = (root / "export/README.md").read_text()
    for section in ("## Started from", "## Lineage", "## Evaluation", "## The bill"):
        assert section in card
    assert "model.safetensors" in card  # the imported checkpoint's hash is named
    assert "code at commit" in card and "| finetune_domain |" in card  # lineage; the bill
    assert "Execution accuracy per kind of question" in card
    # The folder it replaced is only replaced when an export is complete: a refused export
    # (unequal expert counts after a growth edit here) leaves the last one in place.
    before = (root / "export/config.json").read_text()
    bad = root / "models/bad"
    bad.mkdir()
    spec = json.loads((root / "models/finetune_domain/model.json").read_text())
    spec["moe"]["balancing"] = ["util_aware"]
    (bad / "model.json").write_text(json.dumps(spec))
    (bad / "model.safetensors").write_bytes(
        (root / "models/finetune_domain/model.safetensors").read_bytes()
    )
    r = cli(root, env, "model", "export", "models/bad", "--out", "export", ok=False)
    assert r.returncode == 2 and "utilisation-aware" in r.stderr
    assert (root / "export/config.json").read_text() == before


def test_the_lora_stage_keeps_its_adapters_and_exports_them_for_peft(
    ran: tuple[Path, dict[str, str]],
) -> None:
    """finetune_domain (method: lora) froze the finetune_sql model and trained adapters: its
    checkpoints hold the adapters, its model folder the merged model, and `model export`
    writes a PEFT folder against the exported base that PEFT loads with the merged logits."""
    import peft
    from safetensors import safe_open

    from moe.hashing import sha256_file
    from moe.hf.model_dir import load_model_dir

    root, env = ran
    stage = root / "models/finetune_domain"
    spec = json.loads((stage / "adapter.json").read_text())
    assert spec["method"] == "lora" and spec["router"] == "frozen"
    assert spec["base_sha256"] == sha256_file(root / "models/finetune_sql/model.safetensors")
    with safe_open(str(stage / "adapter.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert names and all(".lora" in n for n in names)
    ckpts = sorted((stage / "checkpoints").glob("step_*"))
    state = json.loads((ckpts[-1] / "state.json").read_text())
    assert state["adapter"]["base_sha256"] == spec["base_sha256"]
    base = load_model_dir(root / "models/finetune_sql", dtype=torch.float32)
    ours = load_model_dir(stage, dtype=torch.float32)
    frozen = ("embed.weight", "blocks.0.ffn.router.gate.weight")
    for name in frozen:  # not adapted, frozen: unchanged by the stage
        assert torch.equal(base.get_parameter(name), ours.get_parameter(name))
    moved = "blocks.0.attn.qkv.weight"  # adapted: the merged weight differs
    assert not torch.equal(base.get_parameter(moved), ours.get_parameter(moved))
    out = cli(root, env, "model", "export", "models/finetune_domain", "--out", "lora_export")
    assert "PEFT adapter" in out.stdout
    adapter_dir = root / "lora_export-adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(
        config["base_model_name_or_path"], dtype=torch.float32
    )
    adapted = peft.PeftModel.from_pretrained(hf_base, adapter_dir).eval()
    idx = torch.randint(0, 66_000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - adapted(idx).logits).abs().max()) < 1e-4


def test_ask_prints_the_sql_and_what_it_returns(
    ran: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """`ask` on a model that answers one question: the SQL it writes, then the rows that SQL
    returns, exit 0. A few finetuning steps do not make a SQL writer, so the finetune_domain
    model is taught one of its training questions a few more steps, on the finetune stage's
    own example (the output layer only: seconds), until it writes the answer with a wide
    margin; `ask` builds its prompt from the database itself and must ask the same way."""
    from moe.data.tokenizer import load_tokenizer, specials
    from moe.hf.model_dir import load_model_dir, save_model_dir
    from moe.recipes.finetune import sft_examples
    from moe.sql.evaluate import stop_ids

    root, env = ran
    prepared = root / "data/prepared"
    lines = (prepared / "sql/domain_train.jsonl").read_text().splitlines()
    line = min(lines, key=lambda x: len(json.loads(x)["sql"]))  # e.g. SELECT COUNT(*) FROM doctor
    pair = json.loads(line)
    (tmp_path / "one.jsonl").write_text(line + "\n")
    tok_path = prepared / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    sp = specials(tok, tok_path)
    [ex] = sft_examples(tmp_path / "one.jsonl", tok, sp)
    model = load_model_dir(root / "models/finetune_domain", dtype=torch.float32).eval()
    for name, p in model.named_parameters():
        p.requires_grad_(name in ("lm_head.weight", "norm.weight"))
    x = torch.tensor([ex.prompt + ex.response[:-1]])
    y = torch.tensor([[-100] * (len(ex.prompt) - 1) + ex.response])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(400):
        _, loss, _ = model(x, y, logits=False)
        if float(loss.detach()) < 0.01:  # a mean over ~20 tokens: each far above any other token
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    wrote = model.generate_batch([ex.prompt], 64, stop_ids(tok, sp.eos))[0]
    assert tok.decode(wrote).strip() == pair["sql"], float(loss.detach())
    save_model_dir(model, tmp_path / "asked")
    db = prepared / "sql/dbs" / pair["db"]
    r = cli(root, env, "ask", str(tmp_path / "asked"), pair["question"], "--db", str(db))
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(pair["sql"]).fetchall()
    finally:
        con.close()
    assert rows and r.stdout.splitlines() == [
        pair["sql"],
        *(" | ".join(str(v) for v in row) for row in rows),
        f"-- {len(rows)} row(s)",
    ], r.stdout
    # execution-guided self-consistency: the taught answer, and how many candidates agreed
    voted = cli(root, env, "ask", str(tmp_path / "asked"), pair["question"], "--db", str(db),
                "--candidates", "4")  # fmt: skip
    first, *rest = voted.stdout.splitlines()
    assert re.fullmatch(r"-- [1-4] of 4 candidates agreed \([1-4] ran on the database\)", first)
    assert rest == r.stdout.splitlines(), voted.stdout
    missing = cli(root, env, "ask", "models/finetune_domain", "q", "--db", "nope.sqlite", ok=False)
    assert missing.returncode == 2 and "nope.sqlite" in missing.stderr


def test_the_evaluate_stage_exports_and_publishes_the_final_model(
    ran: tuple[Path, dict[str, str]],
) -> None:
    root, _ = ran
    config = json.loads((root / "models/export/config.json").read_text())
    assert config["model_type"] == "qwen3_moe"  # back to the architecture it came from
    export = json.loads((root / "reports/metrics.json").read_text())["export"]
    assert export["exported"] and export["architecture"] == "Qwen3MoeForCausalLM"
    pub = export["published"]
    stored = root / "store" / "models" / "moe-sql" / pub["version"] / "manifest.json"
    manifest = json.loads(stored.read_text())
    assert manifest["files"]["model.safetensors"]["sha256"] == pub["files"]["model.safetensors"]
    record = json.loads((root / "reports/evaluate/lineage.json").read_text())
    assert record["outputs"]["export"]["path"] == "models/export"
    assert record["metrics"]["model_uri"] == pub["uri"]
    assert record["metrics"]["model_export"] == "Qwen3MoeForCausalLM"


def test_the_pipeline_run_ends_with_its_report_artifact(ran: tuple[Path, dict[str, str]]) -> None:
    """The pipeline flow run's last word in the UI, read through the server's API: the
    results per stage and kind of question, the bill per stage and pool with the saving, the
    interruptions, and a link to each stage's flow run (runs that exist on the server)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from tasks.pools import STAGES
    from tasks.presentation import PIPELINE_REPORT

    root, env = ran
    metrics = json.loads((root / "reports/metrics.json").read_text())
    ledger = json.loads((root / "reports/cost.json").read_text())
    with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
        # this project's run: the report linking its evaluate stage's flow run (another
        # file on this test worker may have left a report of its own on the same server)
        evaluated = json.loads((root / "reports/evaluate/lineage.json").read_text())
        reports = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[PIPELINE_REPORT])),
            sort=ArtifactSort.CREATED_DESC,
        )
        [art] = [a for a in reports if evaluated["flow_run_id"] in a.data]
        text = art.data
        pipeline_run = client.read_flow_run(art.flow_run_id)
        assert client.read_flow(pipeline_run.flow_id).name == "pipeline"
        ids = re.findall(r"- (\w+): \[([0-9a-f-]{36})\]\((\S+)\)", text)
        assert [s for s, _, _ in ids] == list(STAGES)
        for stage, run_id, link in ids:
            assert link.endswith(f"/runs/flow-run/{run_id}")
            assert client.read_flow(client.read_flow_run(run_id).flow_id).name == stage
    for stage in ("pretrain", "finetune_sql", "finetune_domain"):
        head = f"| {stage} | {metrics[stage]['val']['perplexity']:.2f} |"
        rows = [x for x in text.splitlines() if x.startswith(head)]
        assert len(rows) == 1, (head, text)
        row = rows[0]
        assert f"{metrics[stage]['sql']['execution_accuracy']:.3f}" in row
        assert f"{metrics[stage]['generic_heldout']['execution_accuracy']:.3f}" in row
    assert f"**{ledger['total']:.5f}**" in text
    for pool, cost in ledger["by_pool"].items():
        assert f"| {pool} | {cost:.5f} |" in text
    assert f"saved {ledger['saving']:.5f}" in text and "No machine was lost." in text


def test_an_imported_model_is_finetuned_and_measured_without_the_pretrain_stage(
    ran: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A folder `model import` wrote is a model: the finetune recipe starts from it and the
    perplexity recipe measures it, with no pretrain pass (and no Prefect: tests/test_recipes.py
    blocks it); the finetuned folder keeps the import's source record. The Hugging Face folder
    itself is refused with the command that imports it."""
    from tests.test_recipes import recipes, without_orchestration

    root, env = ran
    imported = tmp_path / "imported"
    cli(root, env, "model", "import", "hf_model", "--out", str(imported))
    bare = without_orchestration(tmp_path / "site")
    bare["PYTHONPATH"] = f"{tmp_path / 'site'}:{root}"
    ppl = recipes(["perplexity", "--model", str(imported)], root, bare)
    assert ppl.returncode == 0, ppl.stderr[-3000:]
    assert json.loads(ppl.stdout.strip().splitlines()[-1])["perplexity"] > 1
    out = tmp_path / "finetuned"
    args = ["finetune", "--stage", "finetune_sql", "--init", str(imported), "--out", str(out)]
    run = recipes(args, root, bare)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = yaml.safe_load((root / "params.yaml").read_text())["finetune_sql"]["max_steps"]
    assert json.loads(run.stdout.strip().splitlines()[-1])["steps"] == steps
    source = json.loads((out / "model.json").read_text())["source"]
    assert source == json.loads((imported / "model.json").read_text())["source"]
    raw = recipes([*args[:4], str(root / "hf_model"), *args[5:]], root, bare)
    assert raw.returncode == 2 and "model import" in raw.stderr and "Traceback" not in raw.stderr

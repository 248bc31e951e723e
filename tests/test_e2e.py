"""End to end: `dvc repro` runs the whole pipeline on a tiny config in a temporary copy of the
repository, with every stage's flow reported to a real Prefect server; the outputs chain by
content hash; a second `dvc repro` does nothing; a finetune_domain param change re-runs only
finetune_domain and evaluate; `dvc push`/`pull` restore the outputs from the remote.

Then the README's claims on the real stages of that reproduced project (W&B offline): `--force`,
publish checking the store before it skips, the budget split across stages, Prefect not
retrying bad input, W&B in the pipeline (run id in the lineage record, per-expert values in the
run file), bit-exact resume of a finetune stage and a 2-node finetune. Each test that changes
the project works on its own copy (`scratch`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import ROOT, browse, cli_env, merge, pipeline_cli, tiny_params, ui_settings
from tests.wandb_log import history, run_file

pytestmark = pytest.mark.slow


PLANTED = {
    "HF_TOKEN": "hf_PlantedSecret7Qx91",
    "WANDB_API_KEY": "planted-wandb-key-0c4e2a91",
    "AWS_SESSION_TOKEN": "planted-aws-session-5d8f",
}


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)


@pytest.fixture(scope="module")
def repo(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]
) -> tuple[Path, dict[str, str]]:
    dest = tmp_path_factory.mktemp("repo")
    _copy_repo(dest)
    params = merge(yaml.safe_load((dest / "params.yaml").read_text()), tiny_params())
    params["wandb"]["mode"] = "offline"  # W&B reads WANDB_API_KEY; its files are scanned
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # the copy's code, not the editable install's; planted secrets: they must not appear
    # in any log, artifact, record or output
    env = cli_env(prefect_server, dest, WANDB_MODE="offline", **PLANTED)
    return dest, env


def _run(args: list[str], repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{args} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def repro(repo: tuple[Path, dict[str, str]]) -> subprocess.CompletedProcess:
    """The first `dvc repro` of the whole pipeline: every test that reads its outputs asks
    for this, so each test also runs alone (pytest tests/test_e2e.py::NAME)."""
    root, env = repo
    return _run(["dvc", "repro"], root, env)


@pytest.fixture
def scratch(
    repo: tuple[Path, dict[str, str]], repro: subprocess.CompletedProcess, tmp_path: Path
) -> tuple[Path, dict[str, str]]:
    """A copy of the reproduced project (outputs, DVC cache and lock included) for a test
    that changes params, deletes outputs or commits: the shared one stays as `repro` left
    it, whatever order the tests run in."""
    root, env = repo
    dest = tmp_path / "project"
    shutil.copytree(root, dest, symlinks=True)
    return dest, {**env, "PYTHONPATH": str(dest)}


def _lineage(repo: Path, path: str) -> dict:
    return json.loads((repo / path / "lineage.json").read_text())


def _flow_run_ids(repo: Path) -> set[str]:
    """The flow runs of this project's stages (from their lineage records)."""
    folders = ("data/prepared", "data/published", "models/pretrain", "models/finetune_sql")
    folders += ("models/finetune_domain", "reports/evaluate")
    return {_lineage(repo, f)["flow_run_id"] for f in folders}


def test_dvc_repro_runs_the_pipeline(
    repo: tuple[Path, dict[str, str]], repro: subprocess.CompletedProcess
) -> None:
    root, env = repo
    r = repro
    for stage in ("prepare", "publish", "pretrain", "finetune_sql", "finetune_domain", "evaluate"):
        assert f"Running stage '{stage}'" in r.stdout
    for value in PLANTED.values():
        assert value not in r.stdout and value not in r.stderr  # the logs

    meta = json.loads((root / "data/prepared/meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] > 10_000 and meta["dtype"] == "uint16"
    assert (root / "data/prepared/train.bin").stat().st_size == 2 * meta["splits"]["train"][
        "tokens"
    ]
    receipt = json.loads((root / "data/published/receipt.json").read_text())
    assert (root / "store" / receipt["manifest_key"]).is_file()
    # Every stage's lineage record is also in the object store, beside the data.
    for stage in ("prepare", "publish", "pretrain", "finetune_sql", "finetune_domain", "evaluate"):
        copies = list((root / "store" / "lineage" / stage).glob("*.json"))
        assert copies and json.loads(copies[-1].read_text())["stage"] == stage
    for stage in ("pretrain", "finetune_sql", "finetune_domain"):
        assert (root / "models" / stage / "model.safetensors").is_file()
        report = json.loads((root / "reports" / f"{stage}.json").read_text())
        assert report["steps"] == tiny_params()[stage]["max_steps"]
    metrics = json.loads((root / "reports/metrics.json").read_text())
    assert (
        metrics["pretrain"]["val"]["perplexity"] < tiny_params()["tokenizer"]["vocab_size"]
    )  # learned something
    # The SQL scores are counts over the examples evaluate.max_examples allows, consistent
    # with each other and with the per-template breakdown and the samples.
    sql = metrics["finetune_domain"]["sql"]
    n = tiny_params()["evaluate"]["max_examples"]
    assert sql["examples"] == n
    for key in ("execution_accuracy", "valid_sql", "exact_match"):
        assert sql[key] * n == pytest.approx(round(sql[key] * n)), key
    assert sql["execution_accuracy"] <= sql["valid_sql"]  # a match must run first
    by_t = sql["by_template"]
    assert sum(t["examples"] for t in by_t.values()) == n
    assert sum(t["execution_accuracy"] * t["examples"] for t in by_t.values()) == pytest.approx(
        sql["execution_accuracy"] * n
    )
    by_level = sql["by_difficulty"]  # Spider's levels of the same examples (moe/sql/hardness.py)
    assert set(by_level) <= {"easy", "medium", "hard", "extra"} and len(by_level) > 1
    assert sum(t["examples"] for t in by_level.values()) == n
    assert sum(t["execution_accuracy"] * t["examples"] for t in by_level.values()) == pytest.approx(
        sql["execution_accuracy"] * n
    )
    hits = [x["execution_match"] for x in sql["samples"]]
    assert hits and len(hits) <= n
    if len(hits) == n:
        assert sum(hits) / n == sql["execution_accuracy"]
    cost = json.loads((root / "reports/cost.json").read_text())
    assert set(cost["by_stage"]) == {
        "prepare",
        "publish",
        "pretrain",
        "finetune_sql",
        "finetune_domain",
        "evaluate",
    }
    assert cost["total"] == pytest.approx(
        sum(s["cost"] for s in cost["by_stage"].values()), abs=1e-5
    )
    assert set(cost["by_pool"]) == {"cpu", "gpu-h100", "gpu-a100", "gpu-4090"}
    assert cost["all_on_pool"]["pool"] == "gpu-h100" and cost["saving"] > 0
    for stage, phases in cost["by_phase"].items():
        spent = phases["warm-up"] + phases["convergence"] + phases["plateau"]
        assert 0 < spent <= cost["by_stage"][stage]["cost"] + 1e-6
    assert cost["storage"]["stored_gb"] > 0
    assert (root / "reports/evaluate/cost.png").is_file()
    assert (root / "reports/evaluate/training_loss.png").is_file()
    report = (root / "reports/evaluate/report.md").read_text()
    level = next(lv for lv in ("easy", "medium", "hard", "extra") if lv in by_level)
    assert "per Spider difficulty level" in report
    assert f"{by_level[level]['execution_accuracy']:.2f} ({by_level[level]['examples']})" in report

    # Lineage: each stage's inputs are the previous stages' outputs, by content hash.
    publish, pretrain, ft_sql = (
        _lineage(root, "data/published"),
        _lineage(root, "models/pretrain"),
        _lineage(root, "models/finetune_sql"),
    )
    assert pretrain["inputs"]["receipt"]["sha256"] == publish["outputs"]["receipt"]["sha256"]
    assert ft_sql["inputs"]["init_model"]["sha256"] == pretrain["outputs"]["model"]["sha256"]
    assert (
        pretrain["pool"] == "gpu-h100"
        and pretrain["flow_run_id"]
        and pretrain["params"]["pretrain"]["max_steps"] == 12
    )
    # The resolved configuration is saved beside every output.
    assert (
        yaml.safe_load((root / "models/pretrain/params.yaml").read_text())["model"]["d_model"] == 64
    )

    # Every stage ran as a flow run on the Prefect server and completed (its own runs: the
    # server is shared with tests that leave failed runs on purpose).
    ids = {
        _lineage(root, folder)["flow_run_id"]
        for folder in (
            "data/prepared",
            "data/published",
            "models/pretrain",
            "models/finetune_sql",
            "models/finetune_domain",
            "reports/evaluate",
        )
    }
    req = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/flow_runs/filter",
        data=json.dumps({"flow_runs": {"id": {"any_": sorted(ids)}}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    runs = json.loads(urllib.request.urlopen(req, timeout=10).read())
    assert len(ids) == 6 and {r["id"] for r in runs} == ids
    assert {r["state_type"] for r in runs} == {"COMPLETED"}

    digest = _run(
        ["moe-pipeline", "checkpoint", "digest", "models/pretrain"], root, env
    ).stdout.split()
    assert len(digest[0]) == 64 and "step_00000012" in digest[1]


def test_the_prefect_ui_lists_every_stage_run(
    repo: tuple[Path, dict[str, str]],
    repro: subprocess.CompletedProcess,
    chromium: str,
    tmp_path: Path,
) -> None:
    """What a user sees at the printed link: the UI reaches its own server's API (not the
    default port 4200) and its runs page lists each stage's flow run by name; each training
    stage reported its progress to 100%."""
    root, env = repo
    ui = env["PREFECT_UI_URL"]
    assert ui_settings(ui)["api_url"] == env["PREFECT_API_URL"]
    names, ids = {}, []
    for stage in ("prepare", "publish", "pretrain", "finetune_sql", "finetune_domain", "evaluate"):
        folder = {
            "prepare": "data/prepared",
            "publish": "data/published",
            "evaluate": "reports/evaluate",
        }.get(stage, f"models/{stage}")
        run_id = _lineage(root, folder)["flow_run_id"]
        ids.append(run_id)
        with urllib.request.urlopen(f"{env['PREFECT_API_URL']}/flow_runs/{run_id}") as resp:
            names[stage] = json.loads(resp.read())["name"]
    # The page renders after its API calls return; a loaded machine may need a second look.
    for attempt in range(5):
        dom = browse(chromium, f"{ui}/runs", tmp_path / f"profile{attempt}")
        assert "Can't connect" not in dom
        missing = {s: n for s, n in names.items() if n not in dom}
        if not missing:
            break
    assert not missing, f"the runs page does not list these stages' flow runs: {missing}"
    req = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/artifacts/filter",
        # this project's own runs: other tests on the shared server run stages too
        data=json.dumps(
            {"artifacts": {"type": {"any_": ["progress"]}, "flow_run_id": {"any_": ids}}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    progress = {a["key"]: a["data"] for a in json.loads(urllib.request.urlopen(req).read())}
    for stage in ("pretrain", "finetune-sql", "finetune-domain"):
        assert progress[f"{stage}-progress"] == 100.0, progress


def test_planted_secrets_appear_in_no_output_record_or_artifact(
    repo: tuple[Path, dict[str, str]],
    scratch: tuple[Path, dict[str, str]],
    moto_server: str,
) -> None:
    """The planted tokens are in the environment of every command: W&B (offline) and boto3
    (the AWS session token, sent to S3 on a `dvc push` to an S3 remote) read theirs; none may
    reach a file, a log or an artifact. (HF_TOKEN is read only when the Hub is used, which
    these tests cannot reach.)"""
    import boto3

    root, env = repo
    copy, copy_env = scratch
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket="dvc-secrets"
    )
    _run(["dvc", "remote", "add", "--local", "-f", "s3", "s3://dvc-secrets/c"], copy, copy_env)
    _run(["dvc", "remote", "modify", "--local", "s3", "endpointurl", moto_server], copy, copy_env)
    pushed = _run(["dvc", "push", "-r", "s3"], copy, copy_env)
    needles = [v.encode() for v in PLANTED.values()]
    for n in needles:
        assert n not in (pushed.stdout + pushed.stderr).encode()
    wandb_files = list((root / "wandb").rglob("*.wandb"))
    assert wandb_files  # W&B ran (offline) and wrote its run files
    scanned = 0
    written = [root / d for d in ("data", "models", "reports", "store", "wandb", ".dvc")]
    written += [copy / ".dvc"]
    for path in [p for d in written if d.is_dir() for p in d.rglob("*")] + [root / "dvc.lock"]:
        if not path.is_file():
            continue
        data = path.read_bytes()
        scanned += 1
        for n in needles:
            assert n not in data, f"a planted secret is in {path}"
    assert scanned > 50  # outputs, records, params dumps, W&B offline files, the store, DVC cache
    # Prefect artifacts (the summaries and the cost table) through the server's API.
    req = urllib.request.Request(
        env["PREFECT_API_URL"].rstrip("/") + "/artifacts/filter",
        data=json.dumps(
            {"artifacts": {"flow_run_id": {"any_": sorted(_flow_run_ids(root))}}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        artifacts = resp.read()
    assert b"cost-by-stage" in artifacts and b"pretrain-summary" in artifacts
    for n in needles:
        assert n not in artifacts


def test_lineage_cli_walks_a_model_back_to_the_corpus(
    repo: tuple[Path, dict[str, str]],
    repro: subprocess.CompletedProcess,
) -> None:
    root, env = repo
    r = _run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "lineage",
            "models/finetune_domain/model.safetensors",
            "--json",
        ],
        root,
        env,
    )
    chain = [s for s in json.loads(r.stdout) if not s.get("seen")]
    assert [s["stage"] for s in chain] == [
        "finetune_domain",
        "finetune_sql",
        "pretrain",
        "publish",
        "prepare",
    ]
    assert all(s["status"] == "ok" and s["flow_run_id"] for s in chain)
    meta = json.loads((root / "data/prepared/meta.json").read_text())
    assert chain[-1]["corpus"]["sha256"] == meta["source_sha256"]
    # A changed file is reported as such; an unknown output is an error naming the known ones.
    model = root / "models/pretrain/model.safetensors"
    saved = model.read_bytes()
    try:
        model.write_bytes(saved + b"x")
        r = _run([sys.executable, "-m", "flows.cli", "lineage", "models/pretrain"], root, env)
        assert "[changed since]" in r.stdout
    finally:
        model.write_bytes(saved)
    bad = subprocess.run(
        [sys.executable, "-m", "flows.cli", "lineage", "models/nope"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "models/pretrain/model.safetensors" in bad.stderr


def test_second_repro_is_a_no_op(
    repo: tuple[Path, dict[str, str]],
    repro: subprocess.CompletedProcess,
) -> None:
    root, env = repo
    r = _run(["dvc", "repro"], root, env)
    assert "Running stage" not in r.stdout
    assert "Data and pipelines are up to date" in r.stdout


def test_unchanged_stages_are_skipped_and_say_so(
    repo: tuple[Path, dict[str, str]],
    repro: subprocess.CompletedProcess,
) -> None:
    """Outside DVC too (moe-pipeline run, a deployment): a stage whose params, code and input
    hashes match its lineage record is skipped, says so, and leaves its outputs alone."""
    root, env = repo
    model = root / "models/pretrain/model.safetensors"
    before = model.stat().st_mtime_ns
    r = _run(["moe-pipeline", "run"], root, env)
    out = r.stdout + r.stderr
    for stage in ("prepare", "publish", "pretrain", "finetune_sql", "finetune_domain", "evaluate"):
        assert f"stage {stage} skipped" in out, out[-3000:]
    assert model.stat().st_mtime_ns == before
    # the chain the skip compares: evaluate's recorded input is pretrain's recorded output
    rec = _lineage(root, "reports/evaluate")
    assert (
        rec["inputs"]["pretrain"]["sha256"]
        == _lineage(root, "models/pretrain")["outputs"]["model"]["sha256"]
    )


def test_finetune_domain_param_reruns_only_downstream(scratch: tuple[Path, dict[str, str]]) -> None:
    root, env = scratch
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["finetune_domain"]["lr"] = 1e-4
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = _run(["dvc", "repro"], root, env)
    ran = {line.split("'")[1] for line in r.stdout.splitlines() if line.startswith("Running stage")}
    assert ran == {"finetune_domain", "evaluate"}
    assert _lineage(root, "models/finetune_domain")["params"]["finetune_domain"]["lr"] == 1e-4


def test_dvc_push_and_pull_restore_outputs(scratch: tuple[Path, dict[str, str]]) -> None:
    root, env = scratch
    _run(["dvc", "push"], root, env)
    model = root / "models/finetune_domain/model.safetensors"
    original = model.read_bytes()
    shutil.rmtree(root / "models")
    shutil.rmtree(root / ".dvc" / "cache")
    _run(["dvc", "pull"], root, env)
    assert model.read_bytes() == original
    assert "Running stage" not in _run(["dvc", "repro"], root, env).stdout


def test_dvc_push_and_pull_through_an_s3_remote(
    scratch: tuple[Path, dict[str, str]], moto_server: str
) -> None:
    """The same outputs through an S3 remote (dvc-s3) on the moto server: what a team uses
    instead of the local folder remote."""
    import boto3

    root, env = scratch
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket="dvc-remote"
    )
    s3env = {
        **env,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    _run(["dvc", "remote", "add", "--local", "-f", "s3", "s3://dvc-remote/cache"], root, s3env)
    _run(["dvc", "remote", "modify", "--local", "s3", "endpointurl", moto_server], root, s3env)
    _run(["dvc", "push", "-r", "s3"], root, s3env)
    objects = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").list_objects_v2(
        Bucket="dvc-remote"
    )
    assert objects["KeyCount"] > 5
    model = root / "models/pretrain/model.safetensors"
    original = model.read_bytes()
    shutil.rmtree(root / "models")
    shutil.rmtree(root / ".dvc" / "cache")
    _run(["dvc", "pull", "-r", "s3"], root, s3env)
    assert model.read_bytes() == original
    assert "Running stage" not in _run(["dvc", "repro"], root, s3env).stdout


def test_dvc_metrics_and_experiments_read_at_a_glance(scratch: tuple[Path, dict[str, str]]) -> None:
    """`dvc metrics show` is one row of the figures one compares (per stage perplexity, valid
    SQL and execution accuracy; total cost and saving), and `dvc exp run -S` / `dvc exp show`
    work on the pipeline as DVC users drive it."""
    root, env = scratch
    shown = _run(["dvc", "metrics", "show", "--json"], root, env).stdout
    files = json.loads(shown)[""]["data"]
    assert list(files) == ["reports/summary.json"]
    summary = files["reports/summary.json"]["data"]
    flat = [f"{k}.{m}" for k, v in summary.items() for m in v]
    assert len(flat) <= 12 and "finetune_domain.exec_acc" in flat and "cost.total" in flat
    table = _run(["dvc", "metrics", "show"], root, env).stdout
    assert len([line for line in table.splitlines() if line.strip()]) == 2  # header + one row

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    _run([*git, "add", "-A"], root, env)
    _run([*git, "commit", "-qm", "baseline"], root, env)
    r = _run(["dvc", "exp", "run", "-S", "finetune_domain.lr=3e-4", "-n", "lr3e-4"], root, env)
    ran = {line.split("'")[1] for line in r.stdout.splitlines() if line.startswith("Running stage")}
    assert ran == {"finetune_domain", "evaluate"}
    exps = json.loads(_run(["dvc", "exp", "show", "--json"], root, env).stdout)
    found = [
        e
        for commit in exps
        for e in (commit.get("experiments") or [])
        for rev in e.get("revs", [])
        if rev.get("name") == "lr3e-4"
    ]
    assert found, exps
    rev = found[0]["revs"][0]["data"]
    assert rev["params"]["params.yaml"]["data"]["finetune_domain"]["lr"] == 3e-4
    got = rev["metrics"]["reports/summary.json"]["data"]
    # The changed param moved the stage it feeds, and only that one: finetune_domain's
    # perplexity differs from the baseline's, pretrain's and finetune_sql's are the same.
    assert got["finetune_domain"]["ppl"] != summary["finetune_domain"]["ppl"]
    assert got["pretrain"]["ppl"] == summary["pretrain"]["ppl"]
    assert got["finetune_sql"]["ppl"] == summary["finetune_sql"]["ppl"]
    # The README's comparison command runs and shows the changed param beside the figures.
    wide = {**env, "COLUMNS": "400"}  # a terminal wide enough that no column is cut
    table = _run(["dvc", "exp", "show", "--only-changed", "--no-pager"], root, wide).stdout
    assert "lr3e-4" in table and "finetune_domain.lr" in table and "0.0003" in table


# A one-line edit to each module, and the stages it must (True) or must not (False) rerun:
# the DVC graph follows the code each stage runs, not our file layout, so an edit to SQL,
# Hugging Face export, evaluation or finetune-stage code never retrains the base model.
CODE_EDITS = {
    "moe/sql/generator.py": {"prepare": True, "pretrain": False},
    "moe/sql/prompts.py": {"finetune_sql": True, "pretrain": False},
    "moe/sql/evaluate.py": {"evaluate": True, "pretrain": False, "finetune_sql": False},
    "moe/hf/exporter.py": {"evaluate": True, "pretrain": False, "finetune_domain": False},
    "tasks/finetuning.py": {"finetune_sql": True, "finetune_domain": True, "pretrain": False},
    "flows/bodies/finetune.py": {"finetune_domain": True, "pretrain": False},
    "flows/bodies/evaluate.py": {"evaluate": True, "pretrain": False},
    "tasks/evaluation.py": {"evaluate": True, "pretrain": False},
    "moe/train/trainer.py": {"pretrain": True, "finetune_sql": True, "prepare": False},
    "moe/model/routing.py": {"pretrain": True, "evaluate": True, "prepare": False},
    "moe/checkpoint/store.py": {"pretrain": True, "prepare": False},
}


def test_an_edit_reruns_only_the_stages_that_run_that_code(
    scratch: tuple[Path, dict[str, str]],
) -> None:
    """After a finished `dvc repro`, `dvc status` names the stages a one-line edit reruns."""
    root, env = scratch
    assert json.loads(_run(["dvc", "status", "--json"], root, env).stdout or "{}") == {}
    for path, expected in CODE_EDITS.items():
        module = root / path
        before = module.read_text()
        module.write_text(before + "# an edit\n")
        try:
            status = json.loads(_run(["dvc", "status", "--json"], root, env).stdout or "{}")
        finally:
            module.write_text(before)
        changed = {name.split(":")[-1] for name in status}
        for stage, reruns in expected.items():
            assert (stage in changed) == reruns, f"{path}: {stage} {changed}"


# The README's claims on the real stages of the reproduced project.


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_force_runs_an_unchanged_stage_again(scratch: tuple[Path, dict[str, str]]) -> None:
    root, env = scratch
    before = _lineage(root, "data/prepared")["flow_run_id"]
    assert "stage prepare skipped" in _ok(pipeline_cli(["stage", "prepare"], root, env))
    assert _lineage(root, "data/prepared")["flow_run_id"] == before  # untouched
    out = _ok(pipeline_cli(["stage", "prepare", "--force"], root, env))
    assert "stage prepare skipped" not in out
    forced = _lineage(root, "data/prepared")["flow_run_id"]
    assert forced != before
    out = _ok(pipeline_cli(["stage", "prepare"], root, {**env, "MOE_FORCE": "1"}))
    assert "stage prepare skipped" not in out
    assert _lineage(root, "data/prepared")["flow_run_id"] not in (before, forced)


def test_publish_checks_the_store_before_it_skips(scratch: tuple[Path, dict[str, str]]) -> None:
    root, env = scratch
    receipt = json.loads((root / "data/published/receipt.json").read_text())
    archive = root / "store" / receipt["archive_key"]
    assert "stage publish skipped" in _ok(pipeline_cli(["stage", "publish"], root, env))
    archive.unlink()  # the bucket lost the data; the receipt still says it is there
    out = _ok(pipeline_cli(["stage", "publish"], root, env))
    assert "stage publish skipped" not in out
    assert archive.is_file()
    again = json.loads((root / "data/published/receipt.json").read_text())
    assert (again["version"], again["archive_sha256"]) == (
        receipt["version"],
        receipt["archive_sha256"],
    )  # the same content, uploaded again


def test_the_budget_is_what_upstream_stages_left(scratch: tuple[Path, dict[str, str]]) -> None:
    """cost.budget covers the whole pipeline: finetune_sql gets the budget minus what
    prepare, publish and pretrain cost (their lineage records). A budget just below that
    sum leaves nothing: the stage stops after its first step, saying so, and is not skipped
    on the next run (a stage cut by its budget never is)."""
    root, env = scratch
    # finetune_sql as before its first run (a finished run is skipped whatever the budget)
    shutil.rmtree(root / "models/finetune_sql")
    (root / "reports/finetune_sql.json").unlink()
    spent = sum(
        _lineage(root, f)["cost"] for f in ("data/prepared", "data/published", "models/pretrain")
    )
    assert spent > 0
    budget = f"cost.budget={spent * 0.999!r}"
    out = _ok(pipeline_cli(["stage", "finetune_sql", "--set", budget], root, env))
    assert "is already spent" in out and "before finetune_sql" in out
    report = json.loads((root / "reports/finetune_sql.json").read_text())
    assert report["stop_reason"].startswith("budget") and report["steps"] == 1
    again = _ok(pipeline_cli(["stage", "finetune_sql", "--set", budget], root, env))
    assert "stage finetune_sql skipped" not in again
    # With room left it trains every step.
    _ok(pipeline_cli(["stage", "finetune_sql", "--set", f"cost.budget={spent + 100!r}"], root, env))
    report = json.loads((root / "reports/finetune_sql.json").read_text())
    assert report["steps"] == tiny_params()["finetune_sql"]["max_steps"]


def test_prefect_does_not_retry_bad_input(scratch: tuple[Path, dict[str, str]]) -> None:
    """A corpus whose first record is fine (the pre-flight check passes) and whose third is
    not JSON fails inside the flow with exit 2; the task that read it ran once, though its
    retries are set: a retry cannot fix a file."""
    root, env = scratch
    corpus = root / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "fine too"}\n{not json\n')
    r = pipeline_cli(["stage", "prepare", "--force", "--set", f"data.source={corpus}"], root, env)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "corpus.jsonl, line 3" in r.stderr
    assert "Traceback" not in r.stderr
    req = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/task_runs/filter",
        data=json.dumps(
            {
                "task_runs": {"state": {"type": {"any_": ["FAILED"]}}},
                "sort": "EXPECTED_START_TIME_DESC",
                "limit": 5,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    failed = json.loads(urllib.request.urlopen(req, timeout=10).read())
    mine = [t for t in failed if "corpus.jsonl, line 3" in (t["state"].get("message") or "")]
    assert mine, [t["state"].get("message") for t in failed]
    assert mine[0]["run_count"] == 1 and mine[0]["empirical_policy"]["retries"] > 0
    assert "Retry 1/" not in r.stdout + r.stderr


def test_wandb_logs_the_pipeline_per_expert(
    repo: tuple[Path, dict[str, str]], repro: subprocess.CompletedProcess
) -> None:
    root, _ = repo
    rec = _lineage(root, "models/pretrain")
    assert rec["wandb_run_id"]
    rows = history(run_file(root / "wandb", rec["wandb_run_id"]))
    steps = sorted(s for s, row in rows.items() if "loss" in row)
    assert steps == list(range(4, 13, 4))  # pretrain.log_every 4 of 12 steps
    n_experts = tiny_params()["moe"]["num_experts"]
    share = [rows[12][f"expert_load/layer0/expert{e}/share"] for e in range(n_experts)]
    assert sum(share) == pytest.approx(1.0, abs=1e-3)
    assert rows[12]["loss"] == pytest.approx(
        [
            json.loads(x)
            for x in (root / "models/pretrain/metrics.jsonl").read_text().splitlines()
            if json.loads(x).get("step") == 12 and "loss" in json.loads(x)
        ][0]["loss"]
    )


def test_a_finetune_stage_resumes_bit_exact(
    repo: tuple[Path, dict[str, str]], repro: subprocess.CompletedProcess, tmp_path: Path
) -> None:
    """finetune_sql killed after its step-3 checkpoint (an exception from the step-4 log row,
    what a dying worker looks like to the task) and run again resumes from step 3 and ends
    with the weights of an uninterrupted run."""
    from tasks.config import load_config
    from tasks.finetuning import finetune_model

    root, _ = repo
    cfg = load_config(root / "params.yaml", ["finetune_sql.log_every=1"])
    data, init = root / "data/prepared", root / "models/pretrain"

    def run(out: Path, log_fn) -> object:
        return finetune_model.fn(cfg, "finetune_sql", data, "generic.jsonl", init, out, log_fn)

    straight = run(tmp_path / "straight", lambda row: None)

    def die_at_4(row: dict) -> None:
        if row.get("step") == 4 and "loss" in row:
            raise RuntimeError("worker lost")

    with pytest.raises(RuntimeError, match="worker lost"):
        run(tmp_path / "killed", die_at_4)
    resumed = run(tmp_path / "killed", lambda row: None)
    assert straight.resumed_from is None and resumed.resumed_from == 3
    assert resumed.steps == straight.steps == tiny_params()["finetune_sql"]["max_steps"]
    a = (tmp_path / "straight/model.safetensors").read_bytes()
    assert (tmp_path / "killed/model.safetensors").read_bytes() == a


def test_the_recipes_train_what_the_stages_trained_without_prefect(
    repo: tuple[Path, dict[str, str]], repro: subprocess.CompletedProcess, tmp_path: Path
) -> None:
    """On a machine with torch but no Prefect, DVC or W&B, `python -m moe.recipes` trains
    pretrain and finetune_sql from the prepared data into the model folders the pipeline's
    stages wrote (an earlier or imported model folder as the start: --init): the same steps,
    the same loss, the same weights to float rounding. (Bit for bit they may differ in the
    last place: on this CPU finetune_sql's did by up to 4e-9, as CPU reductions do between
    two processes whose memory is laid out differently; a stage rerun is bit-exact.)"""
    from safetensors.torch import load_file

    from tests.test_recipes import recipes, without_orchestration

    root, _ = repo
    env = without_orchestration(tmp_path / "site")
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{root}"  # the copy's code, as the stages ran
    pre = recipes(["pretrain", "--out", str(tmp_path / "pretrain")], root, env)
    assert pre.returncode == 0, pre.stderr[-3000:]
    fin = ["finetune", "--stage", "finetune_sql", "--init", str(tmp_path / "pretrain")]
    fin = recipes([*fin, "--out", str(tmp_path / "finetune_sql")], root, env)
    assert fin.returncode == 0, fin.stderr[-3000:]
    for stage, run in (("pretrain", pre), ("finetune_sql", fin)):
        result = json.loads(run.stdout.strip().splitlines()[-1])
        report = json.loads((root / "reports" / f"{stage}.json").read_text())
        assert result["steps"] == report["steps"] == tiny_params()[stage]["max_steps"]
        assert result["train_loss"] == pytest.approx(report["train_loss"], rel=1e-5), stage
        ours = load_file(tmp_path / stage / "model.safetensors")
        theirs = load_file(root / "models" / stage / "model.safetensors")
        assert ours.keys() == theirs.keys()
        for name, tensor in ours.items():
            torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)
        model_spec = json.loads((tmp_path / stage / "model.json").read_text())
        assert model_spec == json.loads((root / "models" / stage / "model.json").read_text())
        steps = tiny_params()[stage]["max_steps"]
        assert (tmp_path / stage / "checkpoints" / f"step_{steps:08d}").is_dir(), stage


def test_a_multi_node_finetune_runs_from_the_uploaded_start_model(
    repo: tuple[Path, dict[str, str]],
    repro: subprocess.CompletedProcess,
    tmp_path: Path,
    moto_server: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """finetune_sql.nodes 2 x nproc 1 through the task the stage calls: the launcher uploads
    the start model, each pod (an empty disk) pulls it and the data, trains its share with
    the pairs file and the stage's budget, and the model comes back to the flow run's side."""
    import boto3
    from safetensors.torch import load_file

    import tasks.multinode as mn
    from tasks.archive import publish_dataset
    from tasks.config import StorageConfig, load_config
    from tasks.finetuning import finetune_model
    from tasks.pools import PoolSpec
    from tests import local_cluster
    from tests.conftest import free_port

    root, _ = repo
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket="mn-finetune"
    )
    cfg = load_config(root / "params.yaml")
    cfg.storage = StorageConfig(backend="s3", bucket="mn-finetune", endpoint_url=moto_server)
    cfg.finetune_sql.nodes, cfg.finetune_sql.nproc = 2, 1
    cfg.pools.definitions["cpu-node"] = PoolSpec(price_per_hour=0.1)
    cfg.pools.stages["finetune_sql"] = "cpu-node"
    cfg.multinode.rdzv_port, cfg.multinode.poll_s = free_port(), 0.2
    data, init = root / "data/prepared", root / "models/pretrain"
    receipt = publish_dataset.fn(cfg, data, tmp_path / "pub").to_dict()
    cluster = local_cluster.LocalCluster(tmp_path / "cluster")
    monkeypatch.setattr(mn, "open_cluster", lambda: cluster)
    monkeypatch.chdir(tmp_path)
    local_cluster.reset()
    rows: list[dict] = []
    try:
        result = finetune_model.fn(
            cfg,
            "finetune_sql",
            data,
            "generic.jsonl",
            init,
            tmp_path / "out",
            rows.append,
            budget_left=5.0,
            receipt=receipt,
        )
        [config_map] = [m for m in local_cluster.LocalCluster.created if m["kind"] == "ConfigMap"]
        job = json.loads(config_map["data"]["job.json"])
        name = config_map["metadata"]["name"]
        logs = [(cluster.pod_dir(name, i) / "pod.log").read_text() for i in (0, 1)]
    finally:
        local_cluster.reset()
    assert result.steps == cfg.finetune_sql.max_steps
    assert (job["stage"], job["pairs_file"], job["budget_left"], job["init"]) == (
        "finetune_sql",
        "generic.jsonl",
        5.0,
        "pretrain",
    )
    for i, log in enumerate(logs):  # each node fetched the start model the launcher uploaded
        assert "data, model and" in log, log[-2000:]
        pulled = cluster.pod_dir(name, i) / "models/pretrain/model.safetensors"
        assert pulled.read_bytes() == (init / "model.safetensors").read_bytes()
    got = load_file(str(tmp_path / "out/model.safetensors"))
    start = load_file(str(init / "model.safetensors"))
    assert set(got) == set(start) and any(not (got[k] == start[k]).all() for k in got)
    assert [r["step"] for r in rows if "loss" in r][-1] == cfg.finetune_sql.max_steps

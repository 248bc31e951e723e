"""The README's claims on real stages: `--force`, publish checking the store before it skips,
the budget split across stages, Prefect not retrying bad input, W&B in the pipeline (run id in
the lineage record, per-expert values in the run file) and bit-exact resume of a finetune
stage. One tiny project runs prepare, publish and pretrain once (a real Prefect server,
W&B offline); each test that changes it works on its own copy."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, cli_env, merge, tiny_params
from tests.conftest import pipeline_cli as _cli
from tests.wandb_log import history, run_file

pytestmark = pytest.mark.slow


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]
) -> tuple[Path, dict[str, str]]:
    """A project with prepare, publish and pretrain done (W&B offline)."""
    root = tmp_path_factory.mktemp("claims")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), tiny_params())
    params["wandb"]["mode"] = "offline"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = cli_env(prefect_server, WANDB_MODE="offline")
    _ok(_cli(["run", "--stages", "prepare", "publish", "pretrain"], root, env))
    return root, env


@pytest.fixture
def project(built: tuple[Path, dict[str, str]], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the built project for a test that changes it."""
    root, env = built
    dest = tmp_path / "project"
    shutil.copytree(root, dest, symlinks=True)
    return dest, env


def _lineage(root: Path, folder: str) -> dict:
    return json.loads((root / folder / "lineage.json").read_text())


def test_force_runs_an_unchanged_stage_again(project: tuple[Path, dict[str, str]]) -> None:
    root, env = project
    before = _lineage(root, "data/prepared")["flow_run_id"]
    assert "stage prepare skipped" in _ok(_cli(["stage", "prepare"], root, env))
    assert _lineage(root, "data/prepared")["flow_run_id"] == before  # untouched
    out = _ok(_cli(["stage", "prepare", "--force"], root, env))
    assert "stage prepare skipped" not in out
    forced = _lineage(root, "data/prepared")["flow_run_id"]
    assert forced != before
    out = _ok(_cli(["stage", "prepare"], root, {**env, "MOE_FORCE": "1"}))
    assert "stage prepare skipped" not in out
    assert _lineage(root, "data/prepared")["flow_run_id"] not in (before, forced)


def test_publish_checks_the_store_before_it_skips(project: tuple[Path, dict[str, str]]) -> None:
    root, env = project
    receipt = json.loads((root / "data/published/receipt.json").read_text())
    archive = root / "store" / receipt["archive_key"]
    assert "stage publish skipped" in _ok(_cli(["stage", "publish"], root, env))
    archive.unlink()  # the bucket lost the data; the receipt still says it is there
    out = _ok(_cli(["stage", "publish"], root, env))
    assert "stage publish skipped" not in out
    assert archive.is_file()
    again = json.loads((root / "data/published/receipt.json").read_text())
    assert (again["version"], again["archive_sha256"]) == (
        receipt["version"],
        receipt["archive_sha256"],
    )  # the same content, uploaded again


def test_the_budget_is_what_upstream_stages_left(project: tuple[Path, dict[str, str]]) -> None:
    """cost.budget covers the whole pipeline: finetune_sql gets the budget minus what
    prepare, publish and pretrain cost (their lineage records). A budget just below that
    sum leaves nothing: the stage stops after its first step, saying so, and is not skipped
    on the next run (a stage cut by its budget never is)."""
    root, env = project
    spent = sum(
        _lineage(root, f)["cost"] for f in ("data/prepared", "data/published", "models/pretrain")
    )
    assert spent > 0
    budget = f"cost.budget={spent * 0.999!r}"
    out = _ok(_cli(["stage", "finetune_sql", "--set", budget], root, env))
    assert "is already spent" in out and "before finetune_sql" in out
    report = json.loads((root / "reports/finetune_sql.json").read_text())
    assert report["stop_reason"].startswith("budget") and report["steps"] == 1
    again = _ok(_cli(["stage", "finetune_sql", "--set", budget], root, env))
    assert "stage finetune_sql skipped" not in again
    # With room left it trains every step.
    _ok(_cli(["stage", "finetune_sql", "--set", f"cost.budget={spent + 100!r}"], root, env))
    report = json.loads((root / "reports/finetune_sql.json").read_text())
    assert report["steps"] == tiny_params()["finetune_sql"]["max_steps"]


def test_prefect_does_not_retry_bad_input(project: tuple[Path, dict[str, str]]) -> None:
    """A corpus whose first record is fine (the pre-flight check passes) and whose third is
    not JSON fails inside the flow with exit 2; the task that read it ran once, though its
    retries are set: a retry cannot fix a file."""
    root, env = project
    corpus = root / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "fine too"}\n{not json\n')
    r = _cli(["stage", "prepare", "--force", "--set", f"data.source={corpus}"], root, env)
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


def test_wandb_logs_the_pipeline_per_expert(built: tuple[Path, dict[str, str]]) -> None:
    root, _ = built
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
    built: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """finetune_sql killed after its step-3 checkpoint (an exception from the step-4 log row,
    what a dying worker looks like to the task) and run again resumes from step 3 and ends
    with the weights of an uninterrupted run."""
    from tasks.config import load_config
    from tasks.finetuning import finetune_model

    root, _ = built
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


def test_a_multi_node_finetune_runs_from_the_uploaded_start_model(
    built: tuple[Path, dict[str, str]],
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
    from tasks.config import PoolSpec, StorageConfig, load_config
    from tasks.finetuning import finetune_model
    from tests import local_cluster
    from tests.conftest import free_port

    root, _ = built
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

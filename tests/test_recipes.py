"""The recipes (moe/recipes/) run where the GPU is: a machine whose image has torch and
transformers but not Prefect, DVC or W&B. `python -m moe.recipes` there trains what a stage
trains, into the same model folder and checkpoints; its params are read as strictly as the
pipeline's. (tests/test_e2e.py compares its models with the pipeline's, bit for bit.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from moe.config import ConfigError
from moe.recipes.load import load_params
from moe.recipes.params import Params
from tasks.config import Config, load_config
from tests.test_train import _data

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("prefect", "dvc", "wandb")


def without_orchestration(tmp: Path) -> dict[str, str]:
    """An environment where `import prefect` (dvc, wandb) fails, as on a bare GPU image:
    a package of each name, first on the path, that refuses to load."""
    for name in BLOCKED:
        (tmp / name).mkdir(parents=True, exist_ok=True)
        (tmp / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not installed on this machine')\n"
        )
    return {
        "PYTHONPATH": f"{tmp}:{ROOT}",
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp),
        "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],  # as every test's (conftest.py)
    }


def recipes(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe.recipes", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_blocker_blocks(tmp_path: Path) -> None:
    """The environment the tests below run in really lacks Prefect (else they prove nothing)."""
    env = without_orchestration(tmp_path / "site")
    for name in BLOCKED:
        r = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True
        )
        assert r.returncode == 1 and "is not installed on this machine" in r.stderr, name


def test_pretrain_runs_without_prefect_dvc_or_wandb_and_resumes(tmp_path: Path) -> None:
    """`python -m moe.recipes pretrain` on a machine without the orchestration: the stage's
    model folder (model.safetensors, model.json, metrics.csv) and checkpoints; run again
    with more steps, it resumes from its last checkpoint."""
    data = _data(tmp_path / "data")
    params = tmp_path / "params.yaml"
    model = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32, "dense_hidden": 64}
    pre = {"batch_size": 4, "log_every": 2, "checkpoint_every": 4, "eval_every": 4}
    pre |= {"eval_batches": 1, "warmup_steps": 1, "device": "cpu"}
    doc = {"model": model, "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32}}
    # the orchestration's sections are the pipeline's to check: here they are left alone
    doc |= {"pretrain": pre, "pools": {"stages": {"pretrain": "cpu"}}, "wandb": {"mode": "x"}}
    doc |= {"finetune_sql": {"max_len": 32}, "finetune_domain": {"max_len": 32}}
    params.write_text(yaml.safe_dump(doc))
    env = without_orchestration(tmp_path / "site")
    args = ["pretrain", "--params", str(params), "--data", str(data), "--out", "out"]
    first = recipes([*args, "--set", "pretrain.max_steps=4"], tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["resumed_from"] is None
    out = tmp_path / "out"
    assert {"model.safetensors", "model.json", "metrics.csv"} <= {p.name for p in out.iterdir()}
    assert (out / "checkpoints" / "step_00000004").is_dir()
    assert json.loads((out / "model.json").read_text())["model"]["d_model"] == 32
    weights = (out / "model.safetensors").read_bytes()
    again = recipes([*args, "--set", "pretrain.max_steps=4"], tmp_path, env)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads(again.stdout.strip().splitlines()[-1])
    assert result["resumed_from"] == 4 and result["steps"] == 4  # nothing left to train
    assert (out / "model.safetensors").read_bytes() == weights


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = without_orchestration(tmp_path / "site")
    (tmp_path / "params.yaml").write_text("moe:\n  top_k: 9\n")
    r = recipes(["pretrain", "--data", str(tmp_path)], tmp_path, env)
    assert r.returncode == 2
    assert "moe.top_k" in r.stderr and "line 2" in r.stderr and "Traceback" not in r.stderr
    r = recipes(["perplexity", "--model", "m", "--data", str(tmp_path / "none")], ROOT, env)
    assert r.returncode == 2 and "no prepared data here" in r.stderr


def test_the_recipes_read_the_params_as_the_pipeline_does(tmp_path: Path) -> None:
    """The same file gives the same recipe sections to both readers; the recipes' own checks
    (across sections) are the pipeline's, each named with its line."""
    shipped = ROOT / "params.yaml"
    mine, theirs = load_params(shipped), load_config(shipped)
    assert isinstance(theirs, Params) and isinstance(theirs, Config)
    for section in Params.training_stages() + ("model", "moe", "data", "evaluate"):
        assert getattr(mine, section) == getattr(theirs, section), section
    assert mine.fingerprint("model", "moe", "pretrain") == theirs.fingerprint(
        "model", "moe", "pretrain"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("finetune_sql:\n  max_len: 4096\n  method: lora\n  lora:\n    rank: 0\n")
    for read in (load_params, load_config):
        with pytest.raises(ConfigError) as e:
            read(bad)
        assert "finetune_sql.max_len" in str(e.value) and "model.seq_len" in str(e.value)
        assert "finetune_sql.lora.rank" in str(e.value) and "line 5)" in str(e.value)
    old = tmp_path / "old.yaml"
    old.write_text("train:\n  lr: 0.001\n")
    with pytest.raises(ConfigError, match="now named pretrain"):
        load_params(old)


def test_the_domain_stage_replays_a_share_of_the_sql_stages_pairs() -> None:
    """finetune_domain.replay_pairs: that share of the batches' rows comes from the generic
    pairs (each set keeping its own weights), the batch size unchanged; finetune_sql, with
    no finetune stage before it, refuses the knob."""
    from moe.data.tokens import SFTBatches, SFTExample
    from moe.recipes.finetune import with_replayed

    domain = [SFTExample([1, 2], [3], 2.0 if i == 0 else 1.0) for i in range(30)]
    generic = [SFTExample([7, 8], [9]) for _ in range(400)]
    mixed = with_replayed(domain, generic, 0.25)
    assert len(mixed) == 430 and mixed[0].weight == 2.0  # the domain's own weights stay
    batches = SFTBatches(mixed, 16, 8, seed=0, pad_id=0)
    rows = torch.cat([batches.batch_at(step)[0] for step in range(300)])
    assert rows.shape[0] == 16 * 300
    share = float((rows[:, 0] == 7).float().mean())
    assert abs(share - 0.25) < 0.03, share
    with pytest.raises(ConfigError, match="finetune_sql.replay_pairs"):
        load_params(None, ["finetune_sql.replay_pairs=0.5"])
    assert load_params(None, ["finetune_domain.replay_pairs=0.5"]).finetune_domain.replay_pairs


def test_the_recipes_refuse_an_unknown_section_and_what_torchrun_cannot_split() -> None:
    """A misspelled section is refused (the orchestration's, which tasks/config.py declares,
    are the only others); under torchrun the process count must split the experts and the
    batch, and QLoRA runs alone; replayed generic pairs must fit the domain stage's length."""
    import dataclasses

    from moe.errors import InputError
    from moe.recipes.load import check_world
    from moe.recipes.params import ORCHESTRATION

    declared = {f.name for f in dataclasses.fields(Config)} - {
        f.name for f in dataclasses.fields(Params)
    }
    assert declared == set(ORCHESTRATION)
    with pytest.raises(ConfigError, match="pretrian.lr: pretrian is not a section.*--set"):
        load_params(None, ["pretrian.lr=0.1"])
    params = load_params(None, ["moe.num_experts=8", "pretrain.batch_size=16"])
    check_world(params, "pretrain", 4)  # 8 experts and 16 rows over 4: fine
    with pytest.raises(InputError, match="num_experts \\(8\\) does not split over 3"):
        check_world(params, "pretrain", 3)
    qlora = load_params(None, ["finetune_sql.method=qlora"])
    with pytest.raises(InputError, match="qlora runs in one process"):
        check_world(qlora, "finetune_sql", 2)
    with pytest.raises(ConfigError, match="finetune_domain.max_len .* replay_pairs"):
        load_params(
            None,
            ["finetune_domain.replay_pairs=0.3", "finetune_domain.max_len=64",
             "finetune_sql.max_len=128"],
        )  # fmt: skip


def test_evaluation_holds_the_weights_at_the_training_dtype(tmp_path: Path) -> None:
    """evaluate.dtype auto: bf16 weights on CUDA (half the memory; the fp32 per-expert loop
    never runs there), fp32 on a CPU; asked for bf16 on a CPU, the model loads and decodes in
    bf16 with its rotary tables and router logits still fp32, its answers those of fp32 but
    for rounding."""
    from moe.hf.model_dir import save_model_dir
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer
    from moe.recipes.evaluate import evaluation_dtype, load_for_evaluation
    from moe.sql.config import EvaluateConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert evaluation_dtype("auto", cuda) == torch.bfloat16
    assert evaluation_dtype("auto", cpu) == torch.float32
    assert evaluation_dtype("float32", cuda) == torch.float32
    assert evaluation_dtype("bfloat16", cpu) == torch.bfloat16
    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        64,
    )
    save_model_dir(model, tmp_path / "m")
    fp32 = load_for_evaluation(tmp_path / "m", EvaluateConfig(device="cpu"))
    bf16 = load_for_evaluation(tmp_path / "m", EvaluateConfig(device="cpu", dtype="bfloat16"))
    assert fp32.embed.weight.dtype == torch.float32
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.rope_cos.dtype == torch.float32
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = fp32.eval()(idx)[0], bf16.eval()(idx)[0].float()
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())
    assert len(bf16.generate_batch([idx[0].tolist()], 8)[0]) == 8

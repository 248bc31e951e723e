"""Publishing the exported model (tasks/publish.py): to the object store (a local folder, a
real S3 API from moto's server) or to a Hugging Face model repo (the Hub cannot be reached
from here: tested at the huggingface_hub call boundary with tests/test_storage.py's fake),
read back and checked by hash; and the final export's refusal path."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
import torch

from moe.data.tokenizer import train_tokenizer
from moe.hf.model_dir import save_model_dir
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer
from tasks.publish import export_final, publish_model
from tests.test_storage import FakeHfApi, _cfg


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    """A model folder exported the way the evaluate stage exports the final model."""
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(seq_len=64, n_layer=1, d_model=32), MoEConfig(), 300)
    save_model_dir(model, tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    train_tokenizer([Path(__file__).read_text()], 300).save(str(data / "tokenizer.json"))
    cfg = _cfg(tmp_path)
    cfg.evaluate.publish_model = False
    got = export_final(cfg, tmp_path / "model", tmp_path / "export", data, tmp_path / "reports")
    # untrained, so its aux-free bias is still 0: plain Mixtral represents it
    assert got == {"exported": True, "architecture": "MixtralForCausalLM"}
    return tmp_path / "export"


def _check_round_trip(cfg, folder: Path) -> dict:
    first = publish_model(cfg, folder, "moe-sql")
    again = publish_model(cfg, folder, "moe-sql")
    assert again["version"] == first["version"] and again["uri"] == first["uri"]
    assert set(first["files"]) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    }
    return first


def test_a_model_is_published_to_the_object_store_by_version(
    exported: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path)
    pub = _check_round_trip(cfg, exported)
    stored = tmp_path / "store" / "models" / "moe-sql" / pub["version"]  # local: no prefix
    manifest = json.loads((stored / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"]["sha256"] == pub["files"]["model.safetensors"]
    # A changed model is a new version beside the old one, never over it.
    (exported / "README.md").write_text("# another card\n")
    other = publish_model(cfg, exported, "moe-sql")
    assert other["version"] != pub["version"] and stored.is_dir()


def test_a_model_is_published_to_s3_and_read_back(
    exported: Path, tmp_path: Path, moto_server: str
) -> None:
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket="moe-models"
    )
    cfg = _cfg(tmp_path, backend="s3", bucket="moe-models", endpoint_url=moto_server)
    pub = _check_round_trip(cfg, exported)
    assert pub["uri"].startswith("s3://moe-models/") and pub["version"] in pub["uri"]


def test_a_model_goes_to_a_hub_model_repo_at_its_root(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeHfApi(tmp_path)
    monkeypatch.setattr("huggingface_hub.HfApi", lambda: api)
    cfg = _cfg(tmp_path, backend="hf", hf_repo="me/moe-data", hf_model_repo="me/moe-sql")
    pub = _check_round_trip(cfg, exported)
    assert ("create_repo", "me/moe-sql", "model") in api.calls
    root = api.root / "me/moe-sql" / "main"
    assert (root / "config.json").is_file() and (root / "model.safetensors").is_file()
    assert api.tags[-1] == f"moe-sql-{pub['version']}"
    assert pub["uri"] == f"hf://me/moe-sql@moe-sql-{pub['version']}"


def test_a_model_no_architecture_represents_is_not_exported_and_says_why(
    tmp_path: Path,
) -> None:
    model = MoETransformer(
        ModelConfig(seq_len=64, n_layer=1, d_model=32), MoEConfig(balancing=["util_aware"]), 300
    )
    save_model_dir(model, tmp_path / "model")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "stale.txt").write_text("from the last run")
    got = export_final(
        _cfg(tmp_path), tmp_path / "model", tmp_path / "export", tmp_path, tmp_path / "reports"
    )
    assert got["exported"] is False and "utilisation-aware" in got["reason"]
    note = (tmp_path / "export" / "EXPORT_REFUSED.md").read_text()
    assert "utilisation-aware" in note
    assert not (tmp_path / "export" / "stale.txt").exists()  # no stale model left to serve

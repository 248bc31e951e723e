"""A model a user brings goes out as it came: `moe-pipeline model import` (moe/hf/importer.py
`import_model`), maybe a few training steps, then `model export` (tasks/publish.py
`export_model_dir`), read back by transformers itself. Its dtype, its end token (in
generation_config.json, where `generate` stops), its tokenizer's end and pad tokens, its
family after training and its context length all survive the trip.

Real components only: transformers builds and saves each tiny source model
(`from_config`, `save_pretrained`); its tokenizer is tests/hf_fixture.py's (`</s>` ends a
text, `<s>` begins one, `<extra_0>` pads). Everything runs on the CPU, on a GPU host too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from moe.hf.importer import import_model
from moe.hf.model_dir import load_model_dir
from moe.model.config import MoEConfig
from tests.hf_fixture import make_tokenizer

transformers = pytest.importorskip("transformers")

EOS, PAD, BOS = "</s>", "<extra_0>", "<s>"
# Two blocks, every one MoE; the families' own switches come per test.
SMALL = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
FAMILY = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            head_dim=8,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            use_qk_norm=True,  # which ERNIE-4.5-MoE, the bias's other home, has not
        ),
    ),
}


def hf_folder(
    folder: Path,
    model_type: str = "qwen3_moe",
    dtype: torch.dtype = torch.float32,
    change: Any = None,
    **fields: Any,
) -> torch.nn.Module:
    """A transformers model saved with our fixture's tokenizer (pad `<extra_0>`) in `folder`,
    its norms moved off 1 so that a misplaced tensor shows; `change(model)` edits the weights
    before the save. Returns the model (eval) as saved."""
    vocab = make_tokenizer(folder, vocab=300, extra=1, pad=PAD)
    cls_name, extra = FAMILY[model_type]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(
        **{
            **SMALL,
            "vocab_size": vocab + 8,  # an embedding larger than the tokenizer
            "pad_token_id": vocab - 1,  # <extra_0>, the last token
            "max_position_embeddings": 128,
            **extra,
            **fields,
        }
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        if change is not None:
            change(model)
    model.to(dtype).save_pretrained(folder)
    return model


def import_export(tmp_path: Path, src: Path) -> Path:
    """`model import` of `src`, then `model export` of the imported folder: the export."""
    from tasks.publish import export_model_dir

    import_model(src, tmp_path / "model", MoEConfig(), seq_len=64)
    export_model_dir(tmp_path / "model", tmp_path / "export", tmp_path / "data", tmp_path)
    return tmp_path / "export"


def load(folder: Path, **kw: Any) -> torch.nn.Module:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True, **kw
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return hf.eval()


def logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


IDX = torch.randint(2, 300, (2, 20), generator=torch.Generator().manual_seed(1))


def test_a_bf16_checkpoint_stays_bf16_through_import_and_export(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # the fixture's
    out = import_export(tmp_path, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert set(dtypes.values()) == {"BF16"}, dtypes
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert load(out).dtype == torch.bfloat16  # transformers' default: the checkpoint's dtype
    # The same bf16 weights: the same function, computed in fp32 on both sides.
    src, exported = load(tmp_path / "hf", dtype=torch.float32), load(out, dtype=torch.float32)
    diff = (logits(src, IDX) - logits(exported, IDX)).abs().max()
    assert float(diff) < 1e-5, float(diff)


def _eos_first(model: torch.nn.Module) -> None:
    """Make `</s>` (id 1) every position's likeliest next token: every embedding shares a
    large first component, which the last norm keeps and lm_head's `</s>` row reads."""
    model.model.embed_tokens.weight[:, 0] = 10.0
    model.model.norm.weight[0] = 1.0
    model.lm_head.weight[1, 0] = 5.0


def test_the_exported_generation_config_ends_generate_at_the_end_token(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf", change=_eos_first)
    out = import_export(tmp_path, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id == 1, generation
    hf = load(out, dtype=torch.float32)
    assert hf.generation_config.eos_token_id == 1
    prompt = torch.tensor([[0, 17, 42, 99, 7]])
    mask = torch.ones_like(prompt)
    # The folder's own generation config: no eos_token_id given here.
    gen = hf.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert gen[0, 5:].tolist() == [1], gen  # stopped at </s>, 11 tokens short of the limit
    # The control: told to end at another token, the same model runs to the limit.
    gen = hf.generate(
        prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=2
    )
    assert gen[0, 5:].tolist() == [1] * 12


def test_the_exported_tokenizer_has_the_sources_end_and_pad_tokens(tmp_path: Path) -> None:
    hf_folder(tmp_path / "hf")
    out = import_export(tmp_path, tmp_path / "hf")
    src = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    got = transformers.AutoTokenizer.from_pretrained(out)
    assert (src.eos_token, src.pad_token, src.bos_token) == (EOS, PAD, BOS)  # the fixture's
    assert (got.eos_token, got.pad_token, got.bos_token) == (EOS, PAD, BOS)
    assert (got.eos_token_id, got.pad_token_id) == (src.eos_token_id, src.pad_token_id)
    assert got("SELECT 1").input_ids == src("SELECT 1").input_ids  # <s> in front, as before
    # generation_config.json says the same ids as the tokenizer beside it.
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (
        got.eos_token_id,
        got.pad_token_id,
    )


def _token_store(folder: Path, vocab: int) -> Path:
    """A small learnable token corpus (train and val splits) in `folder`."""
    from moe.data.tokens import token_dtype, write_token_store

    folder.mkdir(parents=True)
    docs = [[(i * 7 + j) % 250 + 2 for j in range(300)] for i in range(8)]
    counts = write_token_store(
        iter(map(str, range(8))),
        lambda b: [docs[int(x)] for x in b],
        1,
        vocab,
        folder,
        {"val": 0.2},
        1,
    )
    meta = {"dtype": str(token_dtype(vocab)), "vocab_size": vocab, "splits": counts}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe", "deepseek_v3", "glm4_moe"])
def test_an_imported_moe_trained_a_few_steps_exports_as_its_own_family(
    model_type: str, tmp_path: Path
) -> None:
    """Imported, started from with model.init (its routing knobs the embedded default's:
    aux-free balancing, which Mixtral and OLMoE have no place for and which trains DeepSeek-V3's
    and GLM-4.5's correction bias), trained by the library's Trainer, saved as a stage saves,
    exported: the family it came from, loaded with every key in place."""
    from moe.checkpoint.store import CheckpointStore
    from moe.data.tokens import BatchSampler, TokenStore
    from moe.hf.model_dir import save_stage_model
    from moe.hf.model_init import build_init_model
    from moe.train.config import PretrainConfig
    from moe.train.trainer import Trainer
    from tasks.config import load_config
    from tasks.publish import export_model_dir

    hf_folder(tmp_path / "hf", model_type)
    import_model(tmp_path / "hf", tmp_path / "model", MoEConfig(), seq_len=32)
    (tmp_path / "params.yaml").write_text("")  # the embedded default, whatever the cwd holds
    cfg = load_config(
        tmp_path / "params.yaml",
        [
            f"model.init={tmp_path / 'model'}",
            "model.seq_len=32",
            "finetune_sql.max_len=32",
            "finetune_domain.max_len=32",
        ],
    )
    assert "aux_free" in MoEConfig().balancing  # what the families above have no place for
    torch.manual_seed(0)
    model = build_init_model(cfg.model, cfg.moe)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = _token_store(tmp_path / "data", model.vocab_size)
    optim = PretrainConfig(
        max_steps=3,  # odd: an aux-free bias, were it on, can step back to 0 after an even count
        batch_size=2,
        grad_accum=1,
        lr=3e-3,
        warmup_steps=1,
        checkpoint_every=100,
        log_every=1,
        device="cpu",
    )
    trainer = Trainer(
        model,
        optim,
        BatchSampler(TokenStore(data, "train"), 2, 32, seed=1),
        CheckpointStore(tmp_path / "ckpt", max_retain=1),
        fingerprint=model_type,
        schedule="cosine",
    )
    assert trainer.fit().steps == 3
    trained = trainer.model
    assert any(not torch.equal(before[k], v) for k, v in trained.state_dict().items())
    save_stage_model(trained, tmp_path / "stage")
    plan = export_model_dir(tmp_path / "stage", tmp_path / "export", tmp_path / "hf", tmp_path)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())  # transformers' own
    assert (config["model_type"], config["architectures"]) == (
        model_type,
        source["architectures"],
    ), config
    assert plan.model_type == model_type
    hf = load(tmp_path / "export", dtype=torch.float32)
    assert [type(hf).__name__] == source["architectures"]
    ours = load_model_dir(tmp_path / "stage", dtype=torch.float32).eval()
    diff = (logits(ours, IDX) - logits(hf, IDX)).abs().max()
    assert float(diff) < 1e-4, float(diff)
    if model_type in ("deepseek_v3", "glm4_moe"):  # the bias aux-free trained is theirs
        assert "aux_free" in trained.mcfg.balancing
        bias = trained.blocks[1].ffn.router.expert_bias_E
        assert float(bias.abs().max()) > 0
        with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
            theirs = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert torch.equal(theirs, bias.float())


def test_an_imported_long_context_model_exports_its_own_context_length(
    tmp_path: Path,
) -> None:
    """A 32k-context checkpoint imported for training at 64 tokens goes out a 32k model."""
    hf_folder(tmp_path / "hf", "mixtral", max_position_embeddings=32768, rope_theta=1e6)
    out = import_export(tmp_path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768, config
    read = transformers.AutoConfig.from_pretrained(out)
    assert read.max_position_embeddings == 32768
    assert read.rope_parameters["rope_theta"] == 1e6

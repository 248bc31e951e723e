"""Hugging Face checkpoints in and out (moe/hf/), against transformers itself.

Nothing is downloaded: transformers builds tiny random models of each architecture from a
config (`from_config`, `save_pretrained`), and reads back what we export (`from_pretrained`
with `output_loading_info`). Norm weights and ERNIE's selection bias are perturbed away from
their defaults so that a tensor put in the wrong place shows in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe.errors import InputError
from moe.hf.exporter import export_hf, export_plan
from moe.hf.importer import import_model, load_hf_model
from moe.hf.model_dir import load_model_dir
from moe.model.config import ModelConfig, MoEConfig
from moe.model.experts import EXPERT_BIASES
from moe.model.transformer import MoETransformer

transformers = pytest.importorskip("transformers")

V = 96
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# model_type: (config class, extra fields). Three layers, so the dense/MoE patterns show.
ARCHS = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, eos_token_id=1)),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        dict(
            moe_intermediate_size=16,
            moe_num_experts=4,
            moe_k=2,
            moe_layer_start_index=1,
            moe_num_shared_experts=1,
            tie_word_embeddings=True,
        ),
    ),
    # The DeepSeek-V3 line: multi-head latent attention with a compressed query, sigmoid
    # routing in 4 groups of 2 (a token may use 2), a routed scale, a dense first block.
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            routed_scaling_factor=2.5,
        ),
    ),
    # GLM-4.5: grouped-query attention with q/k/v biases, q/k norm and half of each head
    # rotated, DeepSeek-V3's MoE layer.
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            head_dim=16,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=2,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            routed_scaling_factor=1.5,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
    ),
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
}
MOE = MoEConfig(num_experts=4, top_k=2, balancing=["aux_free", "z_loss"])


def hf_model(model_type: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    cls_name, extra = ARCHS[model_type]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            bias = "e_score_correction_bias" in name or name.endswith("_bias")
            if p.dim() == 1 and "rotary" not in name or bias:
                p.add_(torch.randn_like(p) * 0.1)
            if model_type != "gpt_oss":
                continue
            # gpt-oss: sinks that weigh, gates and ups past the SwiGLU's clamp (7), logits
            # large enough that greedy tokens vary (and so show a wrong window)
            if name.endswith("sinks"):
                p.add_(torch.randn_like(p))
            elif name.endswith("gate_up_proj"):
                p.normal_()
            elif name in ("lm_head.weight", "model.embed_tokens.weight"):
                p.mul_(20)
    model.save_pretrained(folder)
    return model


def hf_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_import_computes_what_transformers_computes(model_type: str, tmp_path: Path) -> None:
    hf = hf_model(model_type, tmp_path / "hf")
    ours, arch = load_hf_model(tmp_path / "hf", MOE, seq_len=64, dtype=torch.float32)
    ours.eval()
    assert arch.model_type == model_type
    assert arch.upcycled == (model_type in ("llama", "qwen2", "qwen3"))
    if model_type == "gpt_oss":  # what the comparison below rests on
        assert ours.cfg.sliding_layers == [0, 2] and ours.cfg.sliding_window == 4
        assert ours.cfg.rope_type == "yarn" and ours.mcfg.activation == "clamped_swiglu"
    idx = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(idx)[0] - hf_logits(hf, idx)).abs().max()
    assert float(diff) < 1e-5, f"{model_type}: logits differ by {float(diff)}"
    # Greedy tokens on left-padded prompts of different lengths: our batched KV-cache decode
    # against transformers' generate with an attention mask.
    # Each step's logits too (the KV-cache path's, recorded at the output head), not only
    # the argmax, which large logits keep through small errors (a sliding window dropped
    # from the cache path changes no greedy token here).
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    steps: list[torch.Tensor] = []
    hook = ours.lm_head.register_forward_hook(lambda m, i, out: steps.append(out))
    ours_out = ours.generate_batch(prompts, 8)
    hook.remove()
    batch = torch.tensor([[0] * 0 + prompts[0], [0, 0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    gen = hf.generate(
        batch,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert ours_out == [gen.sequences[0, 6:].tolist(), gen.sequences[1, 6:].tolist()]
    assert len(steps) == len(gen.logits) == 8
    for k, (a, b) in enumerate(zip(steps, gen.logits, strict=True)):
        assert float((a - b).abs().max()) < 1e-5, f"{model_type}: step {k}"


# Each MoE family at top-1, with the key its config names the choice count by (and both
# settings of norm_topk_prob where the family reads it).
TOP1 = {
    "qwen3_moe": dict(num_experts_per_tok=1),
    "qwen3_moe-raw": dict(num_experts_per_tok=1, norm_topk_prob=False),
    "qwen2_moe": dict(num_experts_per_tok=1),
    "qwen2_moe-normed": dict(num_experts_per_tok=1, norm_topk_prob=True),
    "mixtral": dict(num_experts_per_tok=1),
    "olmoe": dict(num_experts_per_tok=1),
    "olmoe-normed": dict(num_experts_per_tok=1, norm_topk_prob=True),
    "ernie4_5_moe": dict(moe_k=1),
    "deepseek_v3": dict(num_experts_per_tok=1),
    "glm4_moe": dict(num_experts_per_tok=1),
    "gpt_oss": dict(num_experts_per_tok=1),
}


@pytest.mark.parametrize("case", list(TOP1))
def test_a_top_1_model_imports_with_its_familys_routing_weight(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At top-1 the one chosen expert's weight is the family's: 1 where it renormalises the
    kept weights (Mixtral, gpt-oss, norm_topk_prob: true), the raw probability where it does
    not. The import carries the rule; the logits equal transformers' own (fp32)."""
    model_type = case.split("-")[0]
    cls_name, extra = ARCHS[model_type]
    monkeypatch.setitem(ARCHS, model_type, (cls_name, {**extra, **TOP1[case]}))
    hf = hf_model(model_type, tmp_path / "hf")
    ours, _ = load_hf_model(tmp_path / "hf", MOE, seq_len=64, dtype=torch.float32)
    ours.eval()
    assert ours.mcfg.top_k == 1
    idx = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = float((ours(idx)[0] - hf_logits(hf, idx)).abs().max())
    assert diff < 1e-5, f"{case}: logits differ by {diff}"
    # and the export writes the rule back: transformers reads the exported folder's logits
    export_hf(
        ours, tmp_path / "out", tokenizer_dir(tmp_path), {"eos": 0, "pad": 1, "bos": None}, "card"
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        diff = float((ours(idx)[0] - hf_logits(back.eval(), idx)).abs().max())
    assert diff < 1e-5, f"{case}: the export's logits differ by {diff}"


def test_an_upcycled_dense_model_computes_the_dense_function_at_step_0(tmp_path: Path) -> None:
    hf = hf_model("llama", tmp_path / "hf")
    for experts, k in ((4, 2), (8, 3)):
        mcfg = MoEConfig(num_experts=experts, top_k=k, balancing=["aux_free"])
        ours, arch = load_hf_model(tmp_path / "hf", mcfg, seq_len=64, dtype=torch.float32)
        assert arch.upcycled and ours.experts_per_layer() == [experts] * 3
        assert ours.mcfg.renormalize is True  # the combine weights sum to 1: the dense output
        idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            diff = (ours.eval()(idx)[0] - hf_logits(hf, idx)).abs().max()
        assert float(diff) < 1e-5
        # The experts are copies; the router is not (it must learn to tell them apart).
        w13 = ours.moe_layers[0].experts.w13_EDG
        assert torch.equal(w13[0], w13[-1])
        assert float(ours.moe_layers[0].router.gate.weight.detach().std()) > 0
    with pytest.raises(InputError, match="top_k >= 2"):
        load_hf_model(tmp_path / "hf", MoEConfig(num_experts=4, top_k=1), seq_len=64)
    # moe.num_experts = 1 keeps it dense: no router, the checkpoint's own feed-forwards
    ours, arch = load_hf_model(tmp_path / "hf", MoEConfig(num_experts=1, top_k=1), seq_len=64)
    assert not ours.moe_layers and ours.cfg.dense_layers == [0, 1, 2]
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - hf_logits(hf, idx)).abs().max()) < 1e-5


def perturbed(model: MoETransformer) -> MoETransformer:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith(EXPERT_BIASES):
                p.add_(torch.randn_like(p) * 0.1)
        for layer in model.moe_layers:  # as aux-free training leaves it (zero without it)
            if "aux_free" in model.mcfg.balancing:
                layer.router.expert_bias_E.normal_(0, 0.05)
    return model.eval()


def tokenizer_dir(tmp: Path) -> Path:
    from moe.data.tokenizer import train_tokenizer

    folder = tmp / "tok"
    folder.mkdir()
    text = [Path(__file__).read_text()] * 2
    train_tokenizer(text, V + 200).save(str(folder / "tokenizer.json"))
    return folder


NATIVE = {
    # The embedded default's shape: tied, no q/k norm, aux-free bias -> ERNIE-4.5-MoE.
    "default": (ModelConfig(seq_len=64), MoEConfig(), "ernie4_5_moe"),
    "qk-norm, no bias": (
        ModelConfig(
            seq_len=64,
            qk_norm="head",
            n_kv_head=2,
            tie_embeddings=False,
            n_layer=3,
            dense_layers=[1],
        ),
        MoEConfig(balancing=["z_loss"]),
        "qwen3_moe",
    ),
    "gated shared expert": (
        ModelConfig(seq_len=64, attn_bias=True),
        MoEConfig(shared_expert=True, shared_expert_gate=True, balancing=[], renormalize=False),
        "qwen2_moe",
    ),
    "full q/k norm": (
        ModelConfig(seq_len=64, qk_norm="full"),
        MoEConfig(balancing=["aux_loss"], renormalize=False),
        "olmoe",
    ),
    "plain": (ModelConfig(seq_len=64, tie_embeddings=False), MoEConfig(balancing=[]), "qwen3_moe"),
    # Aux-free over sigmoid scores, groups, a routed scale, a shared expert, the first block
    # dense, half of each head rotated -> GLM-4.5 (its correction bias is ours).
    "sigmoid, aux-free": (
        ModelConfig(
            seq_len=64, n_layer=3, dense_layers=[0], rotary_dim=16, attn_bias=True, qk_norm="head"
        ),
        MoEConfig(
            score_func="sigmoid",
            n_group=4,
            topk_group=2,
            routed_scale=2.0,
            shared_expert=True,
            shared_expert_hidden=512,
        ),
        "glm4_moe",
    ),
    # The same with multi-head latent attention -> DeepSeek-V3.
    "latent attention": (
        ModelConfig(
            seq_len=64,
            n_layer=3,
            dense_layers=[0],
            attention="mla",
            head_dim=16,
            mla_q_rank=24,
            mla_kv_rank=16,
            mla_rope_dim=8,
            mla_v_dim=12,
        ),
        MoEConfig(score_func="sigmoid", n_group=2, topk_group=1, shared_expert=True),
        "deepseek_v3",
    ),
    # gpt-oss's features: sinks, alternating windows, every bias, the clamped SwiGLU, YaRN.
    "gpt-oss": (
        ModelConfig(
            seq_len=64,
            n_layer=3,
            n_kv_head=2,
            tie_embeddings=False,
            attn_bias=True,
            attn_out_bias=True,
            attn_sinks=True,
            sliding_window=4,
            sliding_layers=[0, 2],
            rope_type="yarn",
            rope_scaling=dict(
                factor=32.0,
                original_max_position_embeddings=4096.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=0.0,
            ),
        ),
        MoEConfig(
            activation="clamped_swiglu",
            expert_proj_bias=True,
            router_logit_bias=True,
            balancing=["z_loss"],
        ),
        "gpt_oss",
    ),
}


@pytest.mark.parametrize("case", list(NATIVE))
def test_export_loads_in_transformers_with_equal_logits_and_generations(
    case: str, tmp_path: Path
) -> None:
    mcfg_model, mcfg_moe, expected = NATIVE[case]
    torch.manual_seed(0)
    model = perturbed(MoETransformer(mcfg_model, mcfg_moe, V + 200))
    if case == "plain":  # no q/k norm, no bias: Mixtral when preferred
        expected = "mixtral"
        plan = export_hf(
            model,
            tmp_path / "out",
            tokenizer_dir(tmp_path),
            {"eos": 0, "pad": 1, "bos": None},
            "card",
            prefer="mixtral",
        )
    else:
        plan = export_hf(
            model,
            tmp_path / "out",
            tokenizer_dir(tmp_path),
            {"eos": 0, "pad": 1, "bos": None},
            "# card\n",
        )
    assert plan.model_type == expected
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    hf.eval()
    idx = torch.randint(0, V + 200, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert float((model(idx)[0] - hf(idx).logits).abs().max()) < 1e-5
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    gen = hf.generate(
        torch.tensor([prompts[0], [1, 1, 1, *prompts[1]]]),
        attention_mask=torch.tensor([[1] * 5, [0, 0, 0, 1, 1]]),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=1,
        eos_token_id=None,
    )
    assert model.generate_batch(prompts, 6) == [gen[0, 5:].tolist(), gen[1, 5:].tolist()]
    # Per-expert tensors, as transformers saves them and vLLM reads them (gpt-oss: 3-D).
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    if expected == "gpt_oss":
        assert "model.layers.2.mlp.experts.gate_up_proj" in keys
    else:
        assert any(".experts.3." in k for k in keys)
    assert not any("w13_EDG" in k for k in keys)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("SELECT 1").input_ids


def test_export_then_import_is_bit_identical(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = perturbed(MoETransformer(*NATIVE["default"][:2], V + 200))
    export_hf(model, tmp_path / "out", tokenizer_dir(tmp_path), {"eos": 0, "pad": 1}, "card")
    back, arch = load_hf_model(tmp_path / "out", MoEConfig(), seq_len=64, dtype=torch.float32)
    assert arch.model_type == "ernie4_5_moe"
    a, b = model.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_gpt_oss_export_imports_back_bit_identical(tmp_path: Path) -> None:
    """Sinks, every bias and the interleaved 3-D experts go out and come back unchanged;
    the windows, YaRN and the activation's numbers are read back from config.json."""
    torch.manual_seed(0)
    model = perturbed(MoETransformer(*NATIVE["gpt-oss"][:2], V + 200))
    for layer in model.moe_layers:  # unused without aux_free balancing, so not exported
        layer.router.expert_bias_E.zero_()
    export_hf(model, tmp_path / "out", tokenizer_dir(tmp_path), {"eos": 0, "pad": 1}, "card")
    moe = MoEConfig(balancing=["z_loss"])
    back, arch = load_hf_model(tmp_path / "out", moe, seq_len=64, dtype=torch.float32)
    assert arch.model_type == "gpt_oss"
    for key in ("sliding_window", "sliding_layers", "rope_type", "rope_scaling", "attn_sinks"):
        assert getattr(back.cfg, key) == getattr(model.cfg, key), key
    for key in ("activation", "act_alpha", "act_limit", "expert_proj_bias", "router_logit_bias"):
        assert getattr(back.mcfg, key) == getattr(model.mcfg, key), key
    a, b = model.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_an_expert_perturbed_after_export_changes_the_logits(tmp_path: Path) -> None:
    """The control: the parity above would catch one wrong expert."""
    torch.manual_seed(0)
    model = perturbed(MoETransformer(ModelConfig(seq_len=64), MoEConfig(top_k=2), V + 200))
    export_hf(model, tmp_path / "out", tokenizer_dir(tmp_path), {"eos": 0}, "card")
    idx = torch.randint(0, V + 200, (4, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        aux = model(idx)[2]
    busiest = int(aux.tokens_per_expert[1].argmax())  # an expert these tokens reach
    path = tmp_path / "out" / "model.safetensors"
    tensors = load_file(str(path))
    key = f"model.layers.1.mlp.experts.{busiest}.down_proj.weight"
    tensors[key] = tensors[key] * 1.5
    save_file(tensors, str(path), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        assert float((model(idx)[0] - hf.eval()(idx).logits).abs().max()) > 1e-3


def test_what_no_architecture_represents_is_refused_with_the_reason() -> None:
    base = ModelConfig(seq_len=64)
    util = MoETransformer(base, MoEConfig(balancing=["util_aware"]), V)
    with pytest.raises(InputError, match="utilisation-aware"):
        export_plan(util)
    ramp = MoETransformer(base, MoEConfig(balancing=[]), V)
    ramp.moe_layers[0].router.logit_offset_E[3] = -5.0
    with pytest.raises(InputError, match="ramping in"):
        export_plan(ramp)
    # An aux-free bias with q/k norm: only ERNIE has the bias, and ERNIE has no q/k norm.
    biased = perturbed(MoETransformer(ModelConfig(seq_len=64, qk_norm="head"), MoEConfig(), V))
    with pytest.raises(InputError, match="no selection bias"):
        export_plan(biased)
    # The same model with its bias at zero is plain Qwen3-MoE.
    for layer in biased.moe_layers:
        layer.router.expert_bias_E.zero_()
    assert export_plan(biased).model_type == "qwen3_moe"
    # gpt-oss's features: only gpt-oss has them, and it has no q/k norm.
    sinks = MoETransformer(
        ModelConfig(seq_len=64, qk_norm="head", attn_sinks=True), MoEConfig(balancing=[]), V
    )
    with pytest.raises(InputError, match="qwen3_moe: it has no attention sinks") as e:
        export_plan(sinks)
    assert "gpt_oss: q/k norm; its experts' activation is the clamped SwiGLU" in str(e.value)
    clamped = MoETransformer(base, MoEConfig(balancing=[], activation="clamped_swiglu"), V)
    with pytest.raises(InputError, match="mixtral: it has no clamped SwiGLU"):
        export_plan(clamped)


def test_unsupported_configs_are_refused_by_name(tmp_path: Path) -> None:
    hf_model("qwen3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    original = json.loads(path.read_text())
    for change, message in (
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"some_new_feature": 3}, "some_new_feature"),
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ):
        path.write_text(json.dumps({**original, **change}))
        with pytest.raises(InputError, match=message):
            load_hf_model(tmp_path / "hf", MOE, seq_len=64)
    with pytest.raises(InputError, match="cannot download from the Hub"):
        load_hf_model(Path("Qwen/Qwen3-30B-A3B"), MOE, seq_len=64)


def test_the_deepseek_v3_line_refuses_what_it_does_not_implement_and_skips_mtp_layers(
    tmp_path: Path,
) -> None:
    """DeepSeek-V2's routers, softmax scoring, attention biases on latent attention and a
    linear RoPE scaling are refused by name; a released checkpoint's multi-token-prediction layer (past
    num_hidden_layers, which transformers skips) is skipped, and nothing else past the last
    layer is; Kimi K2 (DeepSeek-V3's architecture under its own model_type) imports the same."""
    hf = hf_model("deepseek_v3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    original = json.loads(path.read_text())
    for change, message in (
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}, "linear"),
    ):
        path.write_text(json.dumps({**original, **change}))
        with pytest.raises(InputError, match=message):
            load_hf_model(tmp_path / "hf", MOE, seq_len=64)
    path.write_text(json.dumps({**original, "model_type": "kimi_k2"}))
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in weights.items() if ".2." in k}
    save_file({**weights, **mtp}, str(tmp_path / "hf" / "model.safetensors"))
    ours, arch = load_hf_model(tmp_path / "hf", MOE, seq_len=64, dtype=torch.float32)
    assert (arch.model_type, ours.cfg.n_layer) == ("kimi_k2", 3)
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - hf_logits(hf, idx)).abs().max()) < 1e-5
    assert export_plan(ours, prefer="kimi_k2").model_type == "deepseek_v3"
    save_file(
        {**weights, "model.embed_tokens.extra": weights["model.norm.weight"].clone()},
        str(tmp_path / "hf" / "model.safetensors"),
    )
    with pytest.raises(InputError, match="model.embed_tokens.extra"):
        load_hf_model(tmp_path / "hf", MOE, seq_len=64)


def test_gpt_oss_fields_we_cannot_honour_are_refused_by_name(tmp_path: Path) -> None:
    hf_model("gpt_oss", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    original = json.loads(path.read_text())
    for change, message in (
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq' \\(only mxfp4"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "layer_types chunked_attention are not implemented",
        ),
        ({"layer_types": ["full_attention"] * 2}, "2 entries for 3 layers"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "'llama3'"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_quick": 2.0}},
            "YaRN field 'beta_quick'",
        ),
        ({"use_kernels_for_everything": True}, "use_kernels_for_everything"),
    ):
        path.write_text(json.dumps({**original, **change}))
        with pytest.raises(InputError, match=message):
            load_hf_model(tmp_path / "hf", MOE, seq_len=64)


YARN = {  # gpt-oss's; DeepSeek-V3's form (mscale ratio, truncated); an explicit attention factor
    "gpt-oss": dict(
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    ),
    "deepseek": dict(
        factor=40.0,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=0.8,
        original_max_position_embeddings=4096,
    ),
    "attention_factor": dict(
        factor=4.0,
        attention_factor=1.5,
        original_max_position_embeddings=32,
    ),
}


@pytest.mark.parametrize("case", list(YARN))
def test_yarn_rotary_tables_are_transformers_own(case: str) -> None:
    """Our YaRN (moe/model/rope.py) against transformers' ROPE_INIT_FUNCTIONS["yarn"]: the
    same inverse frequencies and attention factor, bit for bit; and what architecture.py
    reads from rope_parameters gives them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moe.hf.architecture import _rope_scaling
    from moe.model.rope import yarn_parameters
    from moe.model.transformer import rotary_tables

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **YARN[case]}
    cfg = transformers.GptOssConfig(
        **COMMON, head_dim=16, rope_parameters=dict(params), num_local_experts=4
    )
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rope_type, scaling = _rope_scaling(Path("x"), {**COMMON, "rope_parameters": params})
    assert rope_type == "yarn"
    freq, factor = yarn_parameters(16, 150000.0, scaling)
    assert torch.equal(freq, want_freq) and factor == want_factor
    assert factor != 1.0 and not torch.equal(freq, 1.0 / 150000.0 ** (torch.arange(0, 16, 2) / 16))
    # the tables transformers' rotary embedding computes, at every position
    cos, sin = rotary_tables(64, 16, 150000.0, "yarn", scaling)
    hf_cos, hf_sin = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(cfg)(
        torch.zeros(1, dtype=torch.float32), torch.arange(64)[None]
    )
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_a_qwen3_moe_with_yarn_imports_with_equal_logits(tmp_path: Path) -> None:
    """YaRN is not gpt-oss's alone: a family whose rotary embedding is transformers' common
    one declares it (Family.yarn), and a model with it exports back there, not elsewhere."""
    from moe.hf.families.registry import FAMILIES

    hf_model("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    params = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    path.write_text(json.dumps({**json.loads(path.read_text()), "rope_parameters": params}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours, _ = load_hf_model(tmp_path / "hf", MOE, seq_len=64, dtype=torch.float32)
    assert ours.cfg.rope_scaling == {"factor": 4.0, "original_max_position_embeddings": 64.0}
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - hf.eval()(idx).logits).abs().max()) < 1e-5
    assert export_plan(ours, prefer="qwen3_moe").model_type == "qwen3_moe"
    no_yarn = FAMILIES["qwen2_moe"].feature_refusals(ours.cfg, ours.mcfg)
    assert no_yarn == ["it has no YaRN RoPE"]


def test_deepseek_v3_with_yarn_computes_what_transformers_computes_both_ways(
    tmp_path: Path,
) -> None:
    """DeepSeek-V3's released RoPE is YaRN with mscale and mscale_all_dim: the rotary tables
    (attention factor mscale / mscale_all_dim) and the softmax scale (times mscale_all_dim's
    mscale squared) as transformers computes them, on import and after export."""
    hf_model("deepseek_v3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    params = {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 8.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    }
    path.write_text(json.dumps({**json.loads(path.read_text()), "rope_parameters": params}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours, _ = load_hf_model(tmp_path / "hf", MOE, seq_len=64, dtype=torch.float32)
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = hf.eval()(idx).logits
        assert float((ours.eval()(idx)[0] - want).abs().max()) < 1e-5
    export_hf(ours, tmp_path / "out", tokenizer_dir(tmp_path), {"eos": 0, "pad": 1}, "card")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        assert float((back.eval()(idx).logits - want).abs().max()) < 1e-5


FP4 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4(w_EIO: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference MXFP4 quantiser in the released gpt-oss layout: an (E, in, out) expert
    tensor as blocks (E, out, in / 32, 16) uint8, two FP4 codes a byte (the even element in
    the low nibble), and scales (E, out, in / 32) uint8, a power-of-two exponent + 127 per
    32 values (the largest of them to [4, 8), then the nearest FP4 value)."""
    x = w_EIO.transpose(1, 2).float()
    g = x.reshape(*x.shape[:2], x.shape[2] // 32, 32)
    exp = torch.floor(torch.log2(g.abs().amax(-1).clamp_min(2.0**-100))) - 2
    idx = (g / torch.exp2(exp)[..., None]).unsqueeze(-1).sub(FP4).abs().argmin(-1)
    idx = idx.to(torch.uint8)
    return (idx[..., 0::2] | (idx[..., 1::2] << 4)).contiguous(), (exp + 127).to(torch.uint8)


def test_mxfp4_experts_import_as_transformers_dequantises_them(tmp_path: Path) -> None:
    """A gpt-oss whose experts are MXFP4 blocks and scales (quantization_config mxfp4, as the
    released checkpoints): our import computes what transformers computes on the same folder
    (it dequantises on CPU), not what the float weights before quantisation computed; the
    streamed import writes the same tensors."""
    from moe.checkpoint.tensors import model_tensors
    from moe.hf.importer import stream_hf_weights

    torch.manual_seed(0)
    extra = dict(ARCHS["gpt_oss"][1])
    cfg = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 64}, **extra)
    dense = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    dense.save_pretrained(tmp_path / "dense")
    tensors = load_file(str(tmp_path / "dense" / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[key + "_blocks"], tensors[key + "_scales"] = mxfp4(tensors.pop(key))
    (tmp_path / "mx").mkdir()
    save_file(tensors, str(tmp_path / "mx" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "mx",
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    assert not any(info.values()), info
    ours, _ = load_hf_model(tmp_path / "mx", MOE, seq_len=64, dtype=torch.float32)
    idx = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = ours.eval()(idx)[0]
        assert float((logits - hf.eval()(idx).logits).abs().max()) < 1e-5
        assert float((logits - dense(idx).logits).abs().max()) > 1e-4  # MXFP4 was read
    skeleton, _ = stream_hf_weights(tmp_path / "mx", tmp_path / "w.safetensors", MOE, seq_len=64)
    bf16, _ = load_hf_model(tmp_path / "mx", MOE, seq_len=64)
    got, want = load_file(str(tmp_path / "w.safetensors")), model_tensors(bf16)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    # without quantization_config's method we know, refused by name
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="quant_method 'fp8'"):
        load_hf_model(tmp_path / "mx", MOE, seq_len=64)


def test_sharded_checkpoints_are_read_through_their_index(tmp_path: Path) -> None:
    hf = hf_model("mixtral", tmp_path / "hf")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours, _ = load_hf_model(tmp_path / "sharded", MOE, seq_len=64, dtype=torch.float32)
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - hf_logits(hf, idx)).abs().max()) < 1e-5
    # A shard removed: named, not a traceback from deep inside safetensors.
    first = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(InputError, match=first.name):
        load_hf_model(tmp_path / "sharded", MOE, seq_len=64)


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_the_streamed_import_writes_what_the_whole_model_would(
    model_type: str, tmp_path: Path
) -> None:
    """`model import` writes the weights tensor by tensor (the model never whole in memory):
    the file, read by safetensors itself, holds exactly what loading the whole model and
    saving it gives (every tensor, dtype and bit; routing state at its defaults)."""
    from moe.checkpoint.tensors import model_tensors
    from moe.hf.importer import stream_hf_weights

    hf_model(model_type, tmp_path / "hf")
    skeleton, _ = stream_hf_weights(tmp_path / "hf", tmp_path / "w.safetensors", MOE, seq_len=64)
    assert all(p.is_meta for p in skeleton.parameters())
    whole, _ = load_hf_model(tmp_path / "hf", MOE, seq_len=64)
    want, got = model_tensors(whole), load_file(str(tmp_path / "w.safetensors"))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_a_refused_streamed_import_leaves_no_file(tmp_path: Path) -> None:
    from moe.hf.importer import stream_hf_weights

    hf_model("qwen2_moe", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(InputError, match="1 tensor\\(s\\) of the checkpoint have no place"):
        stream_hf_weights(tmp_path / "hf", tmp_path / "w.safetensors", MOE, seq_len=64)
    assert not (tmp_path / "w.safetensors").exists()


def test_import_writes_a_model_folder_with_the_sources_hashes(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    hf = hf_model("qwen2_moe", tmp_path / "hf")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))  # copied as it is
    source = import_model(tmp_path / "hf", tmp_path / "model", MOE, seq_len=64)
    assert set(source["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    copied = (tmp_path / "model" / "tokenizer.json").read_bytes()
    assert copied == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    ours = load_model_dir(tmp_path / "model", dtype=torch.float32).eval()
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert float((ours(idx)[0] - hf_logits(hf, idx)).abs().max()) < 1e-5


def test_qwen3s_own_tokenizer_prepares_into_uint32_token_files(tmp_path: Path) -> None:
    """A real outside tokenizer: Qwen3's tokenizer.json (151,669 tokens) and its
    tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>, no bos)."""
    from tokenizers import Tokenizer

    from moe.data.tokenizer import specials
    from moe.data.tokens import TokenStore
    from tasks.config import Config
    from tasks.data import build_tokenizer, tokenize_corpus
    from tests.qwen3_tokenizer import qwen3_tokenizer

    folder = qwen3_tokenizer()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "SELECT name FROM 歌手 WHERE 国家 = '中国'; -- 查询所有中国歌手的名字\n"
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(text * (i % 3 + 1) + f"第{i}篇文档。\n")
    cfg = Config()
    cfg.data.source, cfg.data.out_dir = str(corpus), str(tmp_path / "out")
    cfg.tokenizer.path = str(folder / "tokenizer.json")
    work = tmp_path / "work"
    work.mkdir()
    path = build_tokenizer.fn(cfg, work)
    assert (work / "tokenizer_config.json").is_file()  # its special tokens travel with it
    tok = Tokenizer.from_file(str(path))
    sp = specials(tok, path)
    assert (sp.eos, sp.pad, sp.bos) == (
        tok.token_to_id("<|im_end|>"),
        tok.token_to_id("<|endoftext|>"),
        None,
    )
    meta = tokenize_corpus.fn(cfg, work, path)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 150_000
    assert meta["eot_id"] == sp.eos
    store = TokenStore(work, "train")
    ids = store.tokens[: len(store.tokens)].astype("int64").tolist()
    assert max(ids) > 65_535  # ids a uint16 file would have wrapped
    assert "中国歌手" in tok.decode([i for i in ids if i != sp.eos])


K_Q = "model.layers.0.self_attn.q_proj.weight"
K_O = "model.layers.0.self_attn.o_proj.weight"
K_E = "model.layers.0.mlp.experts.1.down_proj.weight"
K_N = "model.norm.weight"


def _broken_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], break_it: Any
) -> tuple[int, str]:
    """`moe-pipeline model import` of transformers' own Qwen3-MoE after `break_it(folder)`,
    over an --out folder that already holds a model: (exit code, stderr)."""
    from flows.cli import main

    hf_model("qwen3_moe", tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.json").write_text("{}")  # a previous import: left as it is
    break_it(tmp_path / "hf")
    capsys.readouterr()  # transformers' own progress bars while the fixture saved
    code = main(["model", "import", str(tmp_path / "hf"), "--out", str(out)])
    err = capsys.readouterr().err
    assert (out / "model.json").read_text() == "{}" and len(list(out.iterdir())) == 1
    assert not (tmp_path / "out.tmp" / "model.safetensors").exists()
    return code, err


def _rewrite(folder: Path, change: Any) -> None:
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    change(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "what,change,named",
    [
        # q_proj one head short: the q/k/v concatenation would fail inside torch
        ("q", lambda t: t.update({K_Q: t[K_Q][:-16]}), K_Q),
        # an expert's down projection of another width
        ("expert", lambda t: t.update({K_E: t[K_E][:, :-1].contiguous()}), K_E),
        # the output projection transposed
        ("o", lambda t: t.update({K_O: t[K_O].t().contiguous()}), K_O),
    ],
)
def test_a_tensor_whose_shape_contradicts_the_config_is_refused_by_name(
    what: str, change: Any, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _broken_import(tmp_path, capsys, lambda f: _rewrite(f, change))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert named in lines[0] and "shape" in lines[0] and "Traceback" not in err


def test_non_finite_weights_are_refused_naming_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def nan(t: dict) -> None:
        t[K_E] = t[K_E].clone()
        t[K_E][3, 2] = float("nan")

    code, err = _broken_import(tmp_path, capsys, lambda f: _rewrite(f, nan))
    assert code == 2 and err.count("\n") == 1 and K_E in err and "non-finite" in err, err


def test_a_truncated_safetensors_file_is_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def truncate(folder: Path) -> None:
        f = folder / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    code, err = _broken_import(tmp_path, capsys, truncate)
    assert code == 2 and err.count("\n") == 1 and "model.safetensors" in err, err
    assert "download it again" in err and "Traceback" not in err


def _edit_config(change: dict) -> Any:
    def edit(folder: Path) -> None:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))

    return edit


@pytest.mark.parametrize(
    "break_it,named",
    [
        (_edit_config({"num_experts_per_tok": 9}), "9 experts"),
        (_edit_config({"num_attention_heads": 5}), "num_key_value_heads=2 does not divide"),
        (
            lambda f: _rewrite(f, lambda t: t.update({K_N: t[K_N].to(torch.int32)})),
            "model.norm.weight' is torch.int32",
        ),
    ],
)
def test_a_config_that_contradicts_itself_or_an_integer_weight_is_refused(
    break_it: Any, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _broken_import(tmp_path, capsys, break_it)
    assert code == 2 and err.count("\n") == 1 and named in err, err


def _duplicate_tensor(folder: Path) -> None:
    """A second shard that holds a tensor the first holds too."""
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({K_N: tensors[K_N] * 2}, str(folder / "extra.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "break_it,named",
    [
        (_duplicate_tensor, "'model.norm.weight' is in both extra.safetensors and model"),
        (lambda f: (f / "tokenizer.json").write_text('{"version": "1.0"}'), "tokenizer.json"),
        (lambda f: (f / "tokenizer_config.json").write_text("[1, 2]"), "not a JSON object"),
    ],
)
def test_a_tensor_held_twice_or_an_unreadable_tokenizer_is_refused(
    break_it: Any, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _broken_import(tmp_path, capsys, break_it)
    assert code == 2 and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "out.tmp").exists()  # nothing left half-written


INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _sharded(folder: Path) -> dict[str, str]:
    """model.safetensors split in two shards with their index, as transformers writes them
    (K_N in the second shard); returns the index's weight map."""
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors, key=lambda k: k == K_N)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    weight_map = {}
    for shard, keys in zip(SHARDS, halves, strict=True):
        save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (folder / "model.safetensors").unlink()
    _write_index(folder, weight_map)
    return weight_map


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _shard_missing(folder: Path) -> None:
    _sharded(folder)
    (folder / SHARDS[0]).unlink()


def _tensor_in_the_wrong_shard(folder: Path) -> None:
    """The index says the first shard holds K_N; the second does."""
    _write_index(folder, {**_sharded(folder), K_N: SHARDS[0]})


def _tensor_in_no_shard(folder: Path) -> None:
    _write_index(folder, {**_sharded(folder), "model.layers.9.mlp.gate.weight": SHARDS[1]})


@pytest.mark.parametrize(
    "break_it,named",
    [
        (_shard_missing, [SHARDS[0], "missing"]),
        (_tensor_in_the_wrong_shard, [repr(K_N), SHARDS[0], "does not hold it"]),
        (_tensor_in_no_shard, ["'model.layers.9.mlp.gate.weight'", SHARDS[1]]),
        (lambda f: (_sharded(f), (f / INDEX).write_text('{"weight_map": ')), ["not JSON"]),
    ],
)
def test_an_index_that_contradicts_its_shards_is_refused_naming_both(
    break_it: Any, named: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """model.safetensors.index.json names a shard that is not there, maps a tensor to a
    shard that does not hold it, or is not JSON: refused naming the index and what it
    names, with nothing left in --out (what the index says is what transformers reads)."""
    code, err = _broken_import(tmp_path, capsys, break_it)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert str(tmp_path / "hf" / INDEX) in lines[0], err
    for part in named:
        assert part in lines[0], err
    assert not (tmp_path / "out.tmp").exists()


def test_a_stage_started_from_a_broken_folder_is_refused_as_import_refuses_it(
    tmp_path: Path,
) -> None:
    """model.init names a folder with a bad tokenizer: the configuration is refused naming
    the file; with NaN weights: building the stage's model is refused naming the tensor."""
    from tokenizers import Tokenizer, models

    from moe.config import ConfigError
    from moe.hf.model_init import build_init_model
    from tasks.config import load_config

    hf_model("qwen3_moe", tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ConfigError, match="tokenizer.json: not a tokenizer"):
        load_config(None, [f"model.init={tmp_path / 'hf'}"])
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))

    def nan(t: dict) -> None:
        t[K_E] = t[K_E].clone()
        t[K_E][0, 0] = float("inf")

    _rewrite(tmp_path / "hf", nan)
    cfg = load_config(None, [f"model.init={tmp_path / 'hf'}"])
    with pytest.raises(InputError, match=f"{K_E}.*non-finite"):
        build_init_model(cfg.model, cfg.moe)


def test_a_field_left_out_means_transformers_default_and_params_never_set_the_experts(
    tmp_path: Path,
) -> None:
    """A DeepSeek-V3 or GLM-4.5 config.json that leaves a field out means what transformers'
    config class defaults it to (GLM rotates half of each head; DeepSeek-V3 routes in 8
    groups...), and our defaults are held to those classes. The experts' architecture is the
    checkpoint's: params.yaml's activation and biases do not reach an import."""
    from moe.hf.architecture import read_architecture
    from moe.hf.families.deepseek_v3 import DEEPSEEK_DEFAULTS
    from moe.hf.families.glm4_moe import GLM_DEFAULTS

    for cls, defaults in (
        (transformers.DeepseekV3Config, DEEPSEEK_DEFAULTS),
        (transformers.Glm4MoeConfig, GLM_DEFAULTS),
    ):
        made = cls()
        for key, value in defaults.items():
            theirs = getattr(made, key, None)
            if theirs is None:  # GLM's partial rotation lives in rope_parameters
                theirs = made.rope_parameters[key]
            assert theirs == value, (cls.__name__, key)
    hf_model("glm4_moe", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["rope_parameters"].pop("partial_rotary_factor", None)
    cfg.pop("partial_rotary_factor", None)
    path.write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours, arch = load_hf_model(tmp_path / "hf", MOE, seq_len=64, dtype=torch.float32)
    assert arch.model.rotary_dim == 8  # half of a 16-wide head
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - hf.eval()(idx).logits).abs().max()) < 1e-5
    mine = MoEConfig(activation="clamped_swiglu", expert_proj_bias=True, router_logit_bias=True)
    moe = read_architecture(tmp_path / "hf", mine, 64).moe
    assert (moe.activation, moe.expert_proj_bias, moe.router_logit_bias) == (
        "swiglu",
        False,
        False,
    )


def test_an_imported_selection_bias_chooses_whichever_balancing_trains_on(
    tmp_path: Path,
) -> None:
    """DeepSeek-V3's correction bias is part of its routing: imported under aux-loss
    balancing (aux_free off) it still chooses, as transformers' router does."""
    hf = hf_model("deepseek_v3", tmp_path / "hf")
    ours, _ = load_hf_model(
        tmp_path / "hf", MoEConfig(balancing=["aux_loss"]), seq_len=64, dtype=torch.float32
    )
    assert float(ours.moe_layers[0].router.expert_bias_E.abs().max()) > 0
    idx = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - hf_logits(hf, idx)).abs().max()) < 1e-5


def test_a_gpt_oss_without_attention_biases_imports(tmp_path: Path) -> None:
    """attention_bias: false is what config.json says, over the family's default (true)."""
    torch.manual_seed(0)
    cls, extra = ARCHS["gpt_oss"]
    cfg = getattr(transformers, cls)(**{**COMMON, **extra, "attention_bias": False})
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours, arch = load_hf_model(tmp_path / "hf", MOE, seq_len=64, dtype=torch.float32)
    assert not arch.model.attn_bias and not arch.model.attn_out_bias
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert float((ours.eval()(idx)[0] - hf_logits(hf, idx)).abs().max()) < 1e-5


def test_what_the_new_routing_and_attention_cannot_combine_with_is_refused() -> None:
    """Latent attention has no q/k norm, biases or partial rotation of ours; growth changes
    the expert count the groups divide; GLM's partial_rotary_factor must say our rotary_dim
    as transformers reads it back (int(head_dim * factor))."""
    from moe.config import Problems, validate
    from moe.model.config import GrowthConfig

    def problems(section: Any) -> str:
        p = Problems()
        validate(section, p)
        return "; ".join(p.items)

    assert "latent attention has no q/k norm" in problems(
        ModelConfig(attention="mla", qk_norm="head")
    )
    assert "latent attention has no q/k norm" in problems(
        ModelConfig(attention="mla", attn_bias=True)
    )
    assert problems(ModelConfig(attention="mla")) == ""
    grown = MoEConfig(num_experts=8, n_group=4, topk_group=2, growth=GrowthConfig(enabled=True))
    assert "growth changes the expert count" in problems(grown)
    model = MoETransformer(
        ModelConfig(seq_len=64, n_layer=2, dense_layers=[0], d_model=176, rotary_dim=30),
        MoEConfig(score_func="sigmoid", shared_expert=True, balancing=[]),
        V,
    )
    with pytest.raises(InputError, match="cannot say rotary_dim 30"):
        export_plan(model)

"""The memory and cost plan for the 2026 MoE families, from their published config.json files
read by our own importer (moe/hf/architecture.py) and counted by our own model on the meta
device (moe/train/memory.py, tasks/fit.py: what `moe-pipeline plan` and the pool check use).

    .venv/bin/python bench/families_plan.py

For each model: its parameters as our model holds them (held against the published total:
a wrong field would show), the active parameters per token, and for full finetuning, LoRA
and QLoRA on the default finetune_domain section: the GPUs of each default pool that hold the
weights, trainable state and one micro-batch's activations, and the bill of the default run
there (6 or 4 FLOPs per active parameter and token at bench/lora.py's MFU of the GPU's
dense bf16 peak). Arithmetic, not measurement; nothing is downloaded (the config fields are
written here from the releases' config.json).

The multi-token-prediction layers are not counted: transformers' model (and ours) does not
hold them.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora import MFU, PEAK_TFLOPS, domain_tokens  # noqa: E402
from moe.hf.architecture import read_architecture  # noqa: E402
from moe.model.transformer import MoETransformer  # noqa: E402
from tasks.config import Config  # noqa: E402
from tasks.fit import METHODS, needs, pool_fits  # noqa: E402

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "initial_context_length": 4096,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4"},
}
MODELS = {
    "gpt-oss-20b (21B)": (GPT_OSS_20B, 21),
    "gpt-oss-120b (117B)": (
        {
            **GPT_OSS_20B,
            "num_hidden_layers": 36,
            "num_local_experts": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 18,
        },
        117,
    ),
    # published total (B), as the release states it (without the MTP layers where noted)
    "DeepSeek-V3 (671B)": (DEEPSEEK_V3, 671),
    "Kimi K2 (1T)": (
        {
            **DEEPSEEK_V3,
            "model_type": "kimi_k2",
            "vocab_size": 163840,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "n_routed_experts": 384,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.827,
            "rope_theta": 50000.0,
        },
        1000,
    ),
    "GLM-4.5 (355B)": (
        {
            "model_type": "glm4_moe",
            "vocab_size": 151552,
            "hidden_size": 5120,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_hidden_layers": 92,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "n_routed_experts": 160,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 3,
            "partial_rotary_factor": 0.5,
            "use_qk_norm": True,
            "attention_bias": True,
            "rope_theta": 1000000,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        355,
    ),
    "GLM-4.5-Air (106B)": (
        {
            "model_type": "glm4_moe",
            "vocab_size": 151552,
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 46,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "partial_rotary_factor": 0.5,
            "use_qk_norm": False,
            "attention_bias": True,
            "rope_theta": 1000000,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        106,
    ),
}


def plan(name: str, hf: dict, published_b: float, cfg: Config, tmp: Path) -> dict:
    folder = tmp / name.split()[0]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    arch = read_architecture(folder, cfg.moe, cfg.model.seq_len)
    with torch.device("meta"):
        model = MoETransformer(arch.model, arch.moe, arch.vocab_size)
    total, active = model.num_params(), model.num_params(active_only=True)
    sec = cfg.finetune_domain
    tokens = domain_tokens(cfg)
    row = {
        "params_b": round(total / 1e9, 1),
        "published_b": published_b,
        "active_b": round(active / 1e9, 2),
        "methods": {},
    }
    for method in METHODS:
        state = needs(arch.model, arch.moe, arch.vocab_size, sec, method)
        fits = pool_fits(state, sec, cfg.pools.definitions)
        flops = tokens * active * (6 if method == "full" else 4)
        pools = {}
        for f in fits:
            pool = cfg.pools.definitions[f.pool]
            hours = flops / (f.gpus_needed * PEAK_TFLOPS[pool.gpu] * 1e12 * MFU) / 3600
            pools[f.pool] = {
                "gpus": f.gpus_needed,
                "bill": round(hours * f.machines * pool.rate, 2),
            }
        row["methods"][method] = {
            "state_gb": round(state.total / 1e9, 1),
            "trainable_m": round(state.trainable / 1e6, 1),
            "pools": pools,
        }
    return row


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--grad-accum", type=int, default=0, help="finetune_domain.grad_accum (0 = default)"
    )
    args = ap.parse_args()
    cfg = Config()
    if args.grad_accum:
        cfg.finetune_domain.grad_accum = args.grad_accum
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (hf, published) in MODELS.items():
            out[name] = plan(name, hf, published, cfg, Path(tmp))
            r = out[name]
            print(
                f"{name}: {r['params_b']}B held ({r['published_b']}B published), {r['active_b']}B active"
            )
            for method, m in r["methods"].items():
                cells = ", ".join(
                    f"{p} {v['gpus']} GPUs ${v['bill']}" for p, v in m["pools"].items()
                )
                print(
                    f"  {method:5s} state {m['state_gb']} GB, trainable {m['trainable_m']}M: {cells}"
                )
    print(json.dumps(out))


if __name__ == "__main__":
    main()

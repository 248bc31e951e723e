"""A stage's LoRA adapters as a PEFT adapter folder (`adapter_config.json` +
`adapter_model.safetensors`) against the exported base, in transformers' names.

Ours to PEFT's, per decoder layer (r = lora.rank, s = alpha / r):
- the fused q/k/v adapter: one A per projection (rows r each of `lora_A`) and its rows of
  `lora_B`, q and k rows in the family's order (the same row map as the weights: B rows
  move, A does not) -> `self_attn.{q,k,v}_proj`; the output projection -> `o_proj`;
- the routed experts' 3-D adapters -> PEFT's `target_parameters` on transformers' fused
  experts (`mlp.experts.gate_up_proj` with rank 2r and alpha 2a, PEFT's own rank_pattern
  for it, and `mlp.experts.down_proj`), in the layout of PEFT's ParamWrapper: lora_A
  (E*r, in) expert-major, lora_B (out, r*E) rank-major.

What a PEFT adapter cannot carry is named (`unsupported`) and the caller writes the merged
model only: base weights the stage trained (router gates, embeddings, head), a moved
selection bias, adapter dropout on routed experts (PEFT's ParamWrapper refuses it), and
adapters on a dense layer's or a shared expert's MLP (PEFT on transformers 5 maps those
names to the fused experts of an MoE model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from moe.hashing import sha256_file, weights_files_digest
from moe.hf.families.protocol import Family
from moe.model.transformer import MoETransformer

PREFIX = "base_model.model."


def unsupported(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[str]:
    """What of a stage's adapter.json / adapter.safetensors a PEFT folder cannot express."""
    out = sorted(
        n for n in tensors if not any(k in n for k in (".lora_A", ".lora_B", ".experts.lora."))
    )
    swiglu = sorted({n.rsplit(".", 2)[0] for n in tensors if _swiglu_adapter(n)})
    if swiglu:
        # PEFT 0.21 on transformers 5 reads gate_proj/up_proj/down_proj in target_modules of
        # an MoE model as its fused experts: a dense layer's or a shared expert's MLP cannot
        # be named (tests/test_lora.py shows it)
        out.append(f"MLP adapters outside the routed experts ({', '.join(swiglu)})")
    if spec.get("router") == "bias-only":
        out.append("router selection bias (router: bias-only moved it)")
    lora = spec.get("lora") or {}
    experts = any(".experts.lora." in n for n in tensors)
    if experts and float(lora.get("dropout") or 0) > 0:
        out.append("routed-expert adapters with dropout > 0 (PEFT's ParamWrapper refuses it)")
    return out


def _swiglu_adapter(name: str) -> bool:
    return ".ffn." in name and any(f".{w}.lora_" in name for w in ("w1", "w2", "w3"))


def _linear(out: dict[str, torch.Tensor], key: str, a: torch.Tensor, b: torch.Tensor) -> None:
    out[f"{PREFIX}{key}.lora_A.weight"] = a.contiguous()
    out[f"{PREFIX}{key}.lora_B.weight"] = b.contiguous()


def peft_tensors(
    model: MoETransformer, tensors: dict[str, torch.Tensor], family: Family, rank: int
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(PEFT state dict, target_modules, target_parameters) for our adapter tensors."""
    c = model.cfg
    out: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    params: list[str] = []
    r = rank
    for i, block in enumerate(model.blocks):
        n = family.names(i)
        pre = f"blocks.{i}."
        if f"{pre}attn.qkv.lora_A" in tensors:
            A, B = tensors[f"{pre}attn.qkv.lora_A"], tensors[f"{pre}attn.qkv.lora_B"]
            bq, bk, bv = B.split(block.attn.widths)
            bq, bk = family.qk_to_hf(bq, bk, c)
            for s, (name, b) in enumerate(zip("qkv", (bq, bk, bv), strict=True)):
                _linear(out, f"{n.p}self_attn.{name}_proj", A[s * r : (s + 1) * r], b)
                modules.add(f"{name}_proj")
        if f"{pre}attn.proj.lora_A" in tensors:
            _linear(
                out,
                f"{n.p}self_attn.o_proj",
                tensors[f"{pre}attn.proj.lora_A"],
                tensors[f"{pre}attn.proj.lora_B"],
            )
            modules.add("o_proj")
        if f"{pre}attn.kv_a.lora_A" in tensors:  # latent attention (DeepSeek-V3)
            q = "q_b" if f"{pre}attn.q_b.lora_A" in tensors else "q"
            # B's rows are output rows: the rotated ones permuted as the base weight's
            bq, bkv = family.qk_to_hf(
                tensors[f"{pre}attn.{q}.lora_B"], tensors[f"{pre}attn.kv_a.lora_B"], c
            )
            theirs = {
                "q_a": "q_a_proj",
                "q_b": "q_b_proj",
                "q": "q_proj",
                "kv_a": "kv_a_proj_with_mqa",
                "kv_b": "kv_b_proj",
            }
            for ours_name, hf_name in theirs.items():
                if f"{pre}attn.{ours_name}.lora_A" not in tensors:
                    continue
                b = {q: bq, "kv_a": bkv}.get(ours_name, tensors[f"{pre}attn.{ours_name}.lora_B"])
                _linear(
                    out, f"{n.p}self_attn.{hf_name}", tensors[f"{pre}attn.{ours_name}.lora_A"], b
                )
                modules.add(hf_name)
        ex = f"{pre}ffn.experts.lora."
        if f"{ex}a13" in tensors:
            a13, b13 = tensors[f"{ex}a13"], tensors[f"{ex}b13"]
            a2, b2 = tensors[f"{ex}a2"], tensors[f"{ex}b2"]
            E = a13.shape[0]
            experts = f"{n.mlp}experts"
            # gate_up_proj is the inner wrapper (listed first), down_proj the outer one
            _linear(
                out,
                f"{experts}.base_layer",
                a13.transpose(1, 2).reshape(E * a13.shape[2], -1),
                family.gate_up_to_hf(b13).permute(2, 1, 0).reshape(b13.shape[2], -1),
            )
            _linear(
                out,
                experts,
                a2.transpose(1, 2).reshape(E * a2.shape[2], -1),
                b2.permute(2, 1, 0).reshape(b2.shape[2], -1),
            )
            for p in (f"{n.mlp}experts.gate_up_proj", f"{n.mlp}experts.down_proj"):
                params.append(p.removeprefix("model."))
    return out, sorted(modules), params


def write_peft_folder(
    model: MoETransformer,
    tensors: dict[str, torch.Tensor],
    spec: dict[str, Any],
    family: Family,
    base_dir: Path,
    out_dir: Path,
) -> Path:
    """adapter_config.json + adapter_model.safetensors in `out_dir` for the base exported to
    `base_dir` (named by its absolute path, so PEFT and vLLM find it)."""
    lora = spec["lora"]
    rank, alpha = int(lora["rank"]), float(lora["alpha"])
    state, modules, params = peft_tensors(model, tensors, family, rank)
    # the routed experts' rank (lora.expert_rank: divided gives each rank // E): PEFT reads
    # it from rank_pattern, gate_up_proj at twice it with twice alpha (the same scale)
    ranks = [t.shape[2] for n, t in tensors.items() if n.endswith(".experts.lora.a2")]
    r_e = ranks[0] if ranks else rank
    # PEFT matches target_parameters by suffix: one entry per distinct parameter name.
    suffixes = sorted({".".join(p.split(".")[-3:]) for p in params}, reverse=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_dir).resolve()),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0 if params else float(lora["dropout"]),
        "bias": "none",
        "target_modules": modules,
        "target_parameters": suffixes or None,
        # PEFT gives the fused gate_up_proj twice the rank (gate and up: r each), same scale
        "rank_pattern": (
            {r".*\.gate_up_proj": 2 * r_e, r".*\.experts\.down_proj": r_e} if params else {}
        ),
        "alpha_pattern": (
            {r".*\.gate_up_proj": 2 * alpha, r".*\.experts\.down_proj": alpha} if params else {}
        ),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def read_adapter_dir(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[str]]:
    """A stage's adapter.json and adapter.safetensors, and why they cannot be a PEFT folder
    against their base (nothing: they can): what PEFT cannot express, a base that is the
    Hugging Face folder itself (continued pretraining), missing here, or changed since."""
    model_dir = Path(model_dir)
    try:
        spec = json.loads((model_dir / "adapter.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {}, {}, [f"{model_dir / 'adapter.json'} is unreadable ({e})"]
    tensors = load_file(str(model_dir / "adapter.safetensors"))
    why = unsupported(spec, tensors)
    base_dir = Path(spec.get("base") or "")
    if (base_dir / "config.json").is_file() and not (base_dir / "model.json").is_file():
        why.append(
            f"the adapters were trained on {base_dir} itself (continued pretraining from "
            "model.init): a PEFT folder is written for the finetune stages"
        )
    elif not (base_dir / "model.safetensors").is_file():
        why.append(f"its base {base_dir} is not here")
    elif spec.get("base_sha256") not in (
        sha256_file(base_dir / "model.safetensors"),
        weights_files_digest(base_dir),  # a continued-pretraining base of ours
    ):
        why.append(f"its base {base_dir} changed since (sha256 {spec.get('base_sha256')})")
    return spec, tensors, why

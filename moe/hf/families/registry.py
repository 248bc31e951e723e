"""The registry of Hugging Face architecture families: config.json's model_type -> its
`Family` (moe/hf/families/protocol.py). Adding a family: its module, and its entry here
(with its import). The order is the order "supported:" lists them in."""

from __future__ import annotations

from moe.hf.families.deepseek_v3 import DEEPSEEK_V3, KIMI_K2
from moe.hf.families.dense import LLAMA, QWEN2, QWEN3
from moe.hf.families.ernie4_5_moe import ERNIE4_5_MOE
from moe.hf.families.glm4_moe import GLM4_MOE
from moe.hf.families.gpt_oss import GPT_OSS
from moe.hf.families.mixtral import MIXTRAL
from moe.hf.families.olmoe import OLMOE
from moe.hf.families.protocol import Family
from moe.hf.families.qwen2_moe import QWEN2_MOE
from moe.hf.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    "qwen3_moe": QWEN3_MOE,
    "qwen2_moe": QWEN2_MOE,
    "mixtral": MIXTRAL,
    "olmoe": OLMOE,
    "ernie4_5_moe": ERNIE4_5_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2": KIMI_K2,
    "glm4_moe": GLM4_MOE,
    "gpt_oss": GPT_OSS,
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
}


def exporters(prefer: str = "") -> list[Family]:
    """The families a model may be exported to, in the order they are tried: `prefer` (the
    architecture it was imported from) first when it is one, then by export_priority."""
    order = sorted(
        (f for f in FAMILIES.values() if f.architecture), key=lambda f: f.export_priority
    )
    first = [f for f in order if f.model_type == prefer]
    return first + [f for f in order if f not in first]

"""The tokenizer files that travel with a model folder: which they are (TOKENIZER_FILES),
copying them between folders, and the tokenizer_config.json our own trained tokenizer needs
to load in transformers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
)


def copy_tokenizer(src: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files `src` has into `dest`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dest) / name)
            copied.append(name)
    return copied


def native_tokenizer_config(eos: str, pad: str, max_len: int) -> dict[str, Any]:
    """tokenizer_config.json for a tokenizer trained by moe/data/tokenizer.py."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": pad,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    }

"""The tokenizer files that travel with a model folder: which they are (TOKENIZER_FILES),
copying them between folders, and the tokenizer_config.json our own trained tokenizer needs
to load in transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from moe.hf.errors import refuse

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


def check_tokenizer(src: Path) -> None:
    """Refuse a tokenizer.json the tokenizers library cannot read, or a tokenizer_config.json
    that is not a JSON object, naming the file."""
    tok, config = Path(src) / "tokenizer.json", Path(src) / "tokenizer_config.json"
    if tok.is_file():
        try:
            Tokenizer.from_file(str(tok))
        except Exception as e:  # the tokenizers library's own parse error
            raise refuse(tok, f"not a tokenizer the tokenizers library reads ({e})") from e
    if config.is_file():
        try:
            ok = isinstance(json.loads(config.read_text()), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise refuse(config, "not a JSON object")


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

"""Byte-level BPE tokenizer: trained locally with `tokenizers` (no hub download), or loaded."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe.errors import InputError

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, PAD]


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Every digit is its own token (as LLaMA and DeepSeek do): a number in the question is
    # copied into the SQL digit by digit instead of as one merged token the model must have
    # seen (bench/RESULTS.md: mis-copied constants were the demo's most common error).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def batch_encoder(tok: Tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """The ids of a batch of texts. `encode_batch_fast` skips the character offsets that
    `encode_batch` computes and we never read: ~1.45x the tokens/s here (bench/RESULTS.md),
    the same ids (tests/test_data.py)."""

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch_fast(texts)]

    return encode


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"tokenizer file not found: {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise InputError(f"{path}: not a tokenizers JSON file ({e})") from e
    for special in SPECIAL_TOKENS:
        if tok.token_to_id(special) is None:
            raise InputError(
                f"{path}: tokenizer lacks the special token {special!r}; add it or train one"
            )
    return tok


def tokenizer_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

"""Byte-level BPE tokenizer: trained locally with `tokenizers` (no hub download), or loaded.

A tokenizer we trained has two special tokens, EOT and PAD. A model's own tokenizer (an
imported Hugging Face model: tokenizer.json beside tokenizer_config.json) names its special
tokens in tokenizer_config.json; `specials` reads them from there, never assumes literals.
Every text is encoded without the tokenizer's post-processor (no BOS or EOS added inside an
example); where a model wants a BOS, the caller puts `Specials.prefix` in front. A model
whose tokenizer carries a chat template is asked in it (`Specials.chat`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]

    return encode


def encode_ids(tok: Tokenizer, text: str) -> list[int]:
    """The ids of one text, without the post-processor's special tokens."""
    return tok.encode(text, add_special_tokens=False).ids


@dataclass(frozen=True)
class Specials:
    eos: int  # ends a document and an answer; generation stops at it
    pad: int  # fills batches (the eos id when the tokenizer has no pad token)
    bos: int | None = None
    add_bos: bool = False  # the model expects bos in front of every sequence
    # the model's own chat template (chat_template.jinja beside tokenizer.json, or
    # tokenizer_config.json's "chat_template"), and the texts of its bos and eos
    chat_template: str | None = None
    bos_text: str = ""
    eos_text: str = ""

    @property
    def prefix(self) -> list[int]:
        if self.chat_template and "bos_token" in self.chat_template:
            return []  # the template writes its own bos
        return [self.bos] if self.add_bos and self.bos is not None else []

    def chat(self, prompt: str) -> str:
        """`prompt` as the user's turn of the model's chat template, ready for the
        assistant's answer (as transformers' apply_chat_template with
        add_generation_prompt=True renders it); `prompt` itself without a template."""
        if not self.chat_template:
            return prompt
        return _template(self.chat_template).render(
            messages=[{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            bos_token=self.bos_text,
            eos_token=self.eos_text,
        )


@functools.lru_cache(maxsize=4)
def _template(source: str) -> Any:
    """A chat template compiled the way transformers compiles it (a sandboxed jinja2
    environment, trim_blocks and lstrip_blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)


def read_chat_template(folder: Path) -> str | None:
    """The chat template a tokenizer folder carries, or None."""
    jinja = Path(folder) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = Path(folder) / name
        if f.is_file():
            try:
                t = json.loads(f.read_text()).get("chat_template")
            except (json.JSONDecodeError, AttributeError):
                t = None
            if isinstance(t, str):
                return t
    return None


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} (AddedToken)
        value = value.get("content")
    return value if isinstance(value, str) else None


def specials(tok: Tokenizer, path: str | Path) -> Specials:
    """The special ids of the tokenizer at `path`: from tokenizer_config.json beside it when
    there is one (a model's own tokenizer), else our EOT and PAD."""
    path = Path(path)
    config = path.with_name("tokenizer_config.json")
    if not config.is_file():
        return Specials(eos=_require(tok, EOT, path), pad=_require(tok, PAD, path))
    try:
        c = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{config}: not JSON (line {e.lineno}: {e.msg})") from e
    ids: dict[str, int | None] = {}
    for role in ("eos", "pad", "bos"):
        text = _token_text(c.get(f"{role}_token"))
        ids[role] = None
        if text is not None:
            ids[role] = tok.token_to_id(text)
            if ids[role] is None:
                raise InputError(
                    f"{config}: {role}_token {text!r} is not in the vocabulary of {path.name}"
                )
    if ids["eos"] is None:
        raise InputError(
            f"{config}: no eos_token; the pipeline needs one to end documents and answers"
        )
    return Specials(
        eos=ids["eos"],  # type: ignore[arg-type]
        pad=ids["pad"] if ids["pad"] is not None else ids["eos"],  # type: ignore[arg-type]
        bos=ids["bos"],
        add_bos=bool(c.get("add_bos_token", False)) and ids["bos"] is not None,
        chat_template=read_chat_template(path.parent),
        bos_text=_token_text(c.get("bos_token")) or "",
        eos_text=_token_text(c.get("eos_token")) or "",
    )


def _require(tok: Tokenizer, special: str, path: Path) -> int:
    i = tok.token_to_id(special)
    if i is None:
        raise InputError(
            f"{path}: tokenizer lacks the special token {special!r} (and there is no"
            " tokenizer_config.json beside it naming its own): add it or train one"
        )
    return i


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"tokenizer file not found: {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise InputError(f"{path}: not a tokenizers JSON file ({e})") from e
    if path.with_name("tokenizer_config.json").is_file():
        specials(tok, path)  # its own special tokens must be in its vocabulary
        return tok
    for special in SPECIAL_TOKENS:
        if tok.token_to_id(special) is None:
            raise InputError(
                f"{path}: tokenizer lacks the special token {special!r}; add it or train one"
            )
    return tok


def tokenizer_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

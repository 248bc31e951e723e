"""A small Hugging Face model folder as a user brings one: transformers' own Qwen3-MoE (random
weights, `from_config` + `save_pretrained`) with a tokenizer that is not ours: `</s>` ends a
text, `<s>` begins one (its post-processor adds it, as Llama's does), no pad token, and an
embedding larger than the vocabulary (as Qwen's). `extra` added tokens make the vocabulary
as large as a test wants (uint32 token files past 65,535; tests/test_hf.py also prepares with
Qwen3's real 151k-token tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moe.data.sources import CorpusStats, iter_documents


def make_tokenizer(folder: Path, vocab: int = 1024, extra: int = 0, pad: str | None = None) -> int:
    """Train a BPE on the stdlib corpus, add `extra` tokens, save tokenizer.json and
    tokenizer_config.json in `folder` (`pad`: its pad_token, e.g. "<extra_0>"; none by
    default). Returns the vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = iter_documents("stdlib", "text", 400_000, CorpusStats())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.add_tokens([f"<extra_{i}>" for i in range(extra)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                **({"pad_token": pad} if pad else {}),
                "add_bos_token": True,
                "model_max_length": 4096,
            }
        )
    )
    return tok.get_vocab_size()


def make_qwen3_moe(folder: Path, vocab_size: int, seed: int = 0) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size + 8,  # an embedding larger than the tokenizer, as Qwen's
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)

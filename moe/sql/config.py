"""The evaluate section: how the final models are scored on SQL (moe/sql/evaluate.py,
consistency.py, testsuite.py), exported and published.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe.config import DEVICE, knob


@dataclass
class EvaluateConfig:
    # Held-out pairs to generate SQL for, per set and model (0 = every one: 200 domain and
    # 200 generic questions by default). Decoding is batched with a KV cache.
    max_examples: int = knob(0, ge=0, note=" (0 = all)")
    max_new_tokens: int = knob(72, ge=1)  # the longest test answer must fit (prepare checks)
    # Test-suite accuracy: a right answer must also be right on this many differently filled
    # copies of its database (moe/sql/testsuite.py; 0 = execution accuracy alone).
    test_suite: int = knob(3, ge=0, le=20)
    # Execution-guided self-consistency (moe/sql/consistency.py): the greedy answer and
    # candidates - 1 sampled at `temperature`, each run on the question's database, the
    # answer most of them agree on. 1 = greedy decoding alone.
    candidates: int = knob(1, ge=1, le=32)
    temperature: float = knob(0.8, gt=0, le=2)  # of the sampled candidates
    # How the candidates vote (moe/sql/consistency.py): plain, the largest group of equal
    # results; rows, a result with rows outvotes an empty one whatever the counts; grounded,
    # a candidate comparing a column with a value the database does not hold has no vote, nor
    # one with a held value the question does not name where another names the question's
    # (moe/sql/grounding.py: `genre_id = 'Rock'`, a wrong name; "French" names 'France').
    vote: Literal["plain", "rows", "grounded"] = "grounded"
    # Identifiers held to each question's (pruned) schema while decoding
    # (moe/sql/constrain.py): after FROM or JOIN one of its tables, after `alias.` one of
    # that table's columns, a bare word where an operand starts one of the columns (after
    # FROM: of the tables the query reads), tables, aliases or SQL's words; literals free.
    # The answer names them in the schema's spelling (moe/sql/spelling.py).
    constrain_identifiers: bool = False
    val_batches: int = knob(16, ge=1)  # batches of held-out text per perplexity
    batch_size: int = knob(64, ge=1)  # questions decoded together
    # auto: the GPU when the evaluating machine has one, else the CPU
    device: str = knob("auto", pattern=DEVICE, note="auto, cpu, cuda or cuda:N")
    # The weights' dtype while scoring and decoding: auto is bf16 on CUDA (the training
    # stages' rule: half the memory, the grouped kernel) and fp32 on a CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Last: the final model as a Hugging Face folder (models/export, with its model card),
    # and that folder published where the data is (storage; storage.hf_model_repo for a Hub
    # model repo), read back and checked by hash.
    export_model: bool = True
    publish_model: bool = True  # publish the export (needs export_model)

"""Resident memory of the Trainer step by step on a SQL stage's own batches, by how many rows
the output head takes: the bisection that found why a packed stage's heap grew (bench/RESULTS.md,
"The review fixes, the grounded vote's forms and a packed stage's memory").

    .venv/bin/python bench/trainer_memory.py PROJECT [--steps 40] [--bucket 64] [--loop]

PROJECT is a bench/sql_real.py project after `moe-pipeline run --stages publish pretrain`
(data/prepared in SmolLM2's tokens, models/pretrain). The recipe
configs/smollm2-135m-sql-cpu.yaml's finetune_sql (packed, replay) trains in this process, as
the stage's Trainer does (`--loop`: bench/packing.py's plain step instead), with the output
head's rows rounded up to a multiple of `--bucket` (moe/model/transformer.py
`LOSS_ROW_BUCKET`; 1: as they come). Prints RssAnon in MB after each step, as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from hf_import import anon_mb  # noqa: E402
from packing import step  # noqa: E402

import moe.model.transformer as T  # noqa: E402
from moe.data.tokenizer import load_tokenizer, specials  # noqa: E402
from moe.data.tokens import BatchSampler, MixedBatches, SFTBatches, TokenStore  # noqa: E402
from moe.hf.model_dir import load_model_dir  # noqa: E402
from moe.recipes.finetune import focus_token_ids, sft_examples  # noqa: E402
from moe.recipes.params import read_params  # noqa: E402
from tasks.config import from_dict  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--bucket", type=int, default=T.LOSS_ROW_BUCKET)
    ap.add_argument("--loop", action="store_true", help="bench/packing.py's step, no Trainer")
    a = ap.parse_args()
    T.LOSS_ROW_BUCKET = a.bucket
    recipe = ROOT / "configs/smollm2-135m-sql-cpu.yaml"
    raw, lines, src = read_params(recipe, ["model.init=", "data.sql_generic_source=generated"])
    f = from_dict(raw, lines, src, resolve=False, check_fit=False).finetune_sql
    d = a.project / "data/prepared"
    tok = load_tokenizer(d / "tokenizer.json")
    sp = specials(tok, d / "tokenizer.json")
    focus = focus_token_ids(tok, f.focus_tokens)
    sft = SFTBatches(
        sft_examples(d / "sql/generic.jsonl", tok, sp), f.batch_size, f.max_len, f.seed,
        sp.pad, focus, f.focus_weight, packing=True, micro_batches=f.grad_accum,
    )  # fmt: skip
    rows = max(1, round(sft.rows * f.replay_ratio))
    replay = BatchSampler(TokenStore(d, f.replay_split), rows, f.max_len, f.seed + 1)
    batches = MixedBatches(sft, replay)
    model = load_model_dir(a.project / "models/pretrain", torch.float32)
    out: list[tuple[int, int]] = []
    if a.loop:
        opt = torch.optim.AdamW(model.parameters(), lr=f.lr, fused=True)
        model.train()
        for s in range(a.steps):
            step(model, opt, batches.batch_at(s), torch.bfloat16, torch.device("cpu"))
            out.append((s + 1, round(anon_mb())))
    else:
        from moe.checkpoint.store import CheckpointStore
        from moe.train.trainer import Trainer

        f.max_steps, f.log_every, f.checkpoint_every = a.steps, 1, 10**6
        Trainer(
            model, f, batches, CheckpointStore(Path(tempfile.mkdtemp()), max_retain=1),
            fingerprint="bench", schedule="linear", min_lr=0.0, expert_warmup=False,
            router_lr_mult=1.0,
            log_fn=lambda row: out.append((row["step"], round(anon_mb()))) if "loss" in row else None,
        ).fit()  # fmt: skip
    print(json.dumps({"bucket": a.bucket, "loop": a.loop, "rss_mb_at_step": out}))


if __name__ == "__main__":
    main()

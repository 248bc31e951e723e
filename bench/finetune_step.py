"""One finetuning step's forward + backward with the output head everywhere (`logits=True`)
against the head only where a target counts (`logits=False`, what training runs), on the
real finetune_sql batches (SFT rows plus replay rows) and the pretrained model, interleaved
A B A B after 4 warm-up batches, medians. Needs a finished `make demo` (data/prepared,
models/pretrain). JSON last.

Run: `.venv/bin/python bench/finetune_step.py [--batches 20]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moe.data.tokenizer import load_tokenizer, specials
from moe.data.tokens import BatchSampler, MixedBatches, SFTBatches, TokenStore
from moe.hf.model_dir import load_model_dir
from moe.recipes.finetune import sft_examples
from tasks.config import load_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20)
    args = ap.parse_args()
    cfg = load_config()
    f, d = cfg.finetune_sql, Path(cfg.data.out_dir)
    tok = load_tokenizer(d / "tokenizer.json")
    sp = specials(tok, d / "tokenizer.json")
    examples = sft_examples(d / "sql" / "generic.jsonl", tok, sp)
    rows = max(1, round(f.batch_size * f.replay_ratio))
    batches = MixedBatches(
        SFTBatches(examples, f.batch_size, f.max_len, f.seed, sp.pad, set(), 1.0),
        BatchSampler(TokenStore(d, f.replay_split), rows, f.max_len, f.seed + 1),
    )
    model = load_model_dir(Path("models/pretrain"), torch.float32)
    times: dict[bool, list[float]] = {True: [], False: []}
    counted = []
    for step in range(4 + args.batches):
        x, y, w = batches.batch_at(step)
        counted.append(float((y != -100).float().mean()))
        for full in (True, False):
            t0 = time.perf_counter()
            _, loss, aux = model(x, y, w, logits=full)
            (loss + aux.balance_loss).backward()
            model.zero_grad(set_to_none=True)
            if step >= 4:
                times[full].append(time.perf_counter() - t0)
    full, kept = statistics.median(times[True]), statistics.median(times[False])
    print(f"full head {1000 * full:.1f} ms, loss positions only {1000 * kept:.1f} ms")
    print(
        json.dumps(
            {
                "full_ms": round(1000 * full, 1),
                "loss_positions_ms": round(1000 * kept, 1),
                "ratio": round(kept / full, 3),
                "fraction_of_positions_with_loss": round(statistics.mean(counted), 3),
            }
        )
    )


if __name__ == "__main__":
    main()

"""Does LoRA learn what full finetuning learns? The demo's finetune_sql model finetuned on the
domain pairs (data/prepared/sql/domain_train.jsonl) with each method, 3 seeds each; the
held-out loss on the domain test pairs (answers only, as training weighs them) before and
after. Needs a finished `make demo`. JSON last.

Run: `.venv/bin/python bench/lora_learning.py [--steps 200] [--seeds 3]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from moe.adapters.config import LoraConfig
from moe.adapters.method import apply_method
from moe.checkpoint.store import CheckpointStore
from moe.data.tokenizer import load_tokenizer, specials
from moe.data.tokens import SFTBatches
from moe.hf.model_dir import load_model_dir
from moe.recipes.finetune import sft_examples
from moe.train.config import FinetuneConfig
from moe.train.trainer import Trainer

RUNS = {  # name: (method, lr)
    "full 2e-3": ("full", 2e-3),
    "lora 2e-3": ("lora", 2e-3),
    "lora 6e-3": ("lora", 6e-3),
}


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: SFTBatches, n: int) -> float:
    model.eval()
    losses = [float(model(*batches.batch_at(i))[1]) for i in range(n)]
    model.train()
    return statistics.mean(losses)


def run(base: Path, data: Path, method: str, lr: float, seed: int, steps: int) -> dict:
    tok = load_tokenizer(data / "tokenizer.json")
    sp = specials(tok, data / "tokenizer.json")
    train = sft_examples(data / "sql" / "domain_train.jsonl", tok, sp)
    test = sft_examples(data / "sql" / "domain_test.jsonl", tok, sp)
    cfg = FinetuneConfig(
        max_steps=steps,
        lr=lr,
        warmup_steps=5,
        seed=seed,
        device="cpu",
        method=method,  # type: ignore[arg-type]
        lora=LoraConfig(),
        checkpoint_every=10_000,
        log_every=10_000,
    )
    torch.manual_seed(seed)
    model = load_model_dir(base, torch.float32)
    held = SFTBatches(test, 16, cfg.max_len, 0, sp.pad, set(), 1.0)
    n_eval = max(1, len(test) // 16)
    before = held_out_loss(model, held, n_eval)
    apply_method(model, cfg, method)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(
            model,
            cfg,
            SFTBatches(train, cfg.batch_size, cfg.max_len, seed, sp.pad, set(), 1.0),
            CheckpointStore(Path(tmp), background=False),
            fingerprint=f"{method}{lr}{seed}",
            schedule="linear",
            expert_warmup=False,
            base_sha256=None if method == "full" else "demo",
        )
        t.fit()
    return {"before": before, "after": held_out_loss(model, held, n_eval), "trainable": trainable}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    base, data = Path("models/finetune_sql"), Path("data/prepared")
    results: dict[str, list[dict]] = {k: [] for k in RUNS}
    for seed in range(args.seeds):  # interleaved: each seed runs every method
        for name, (method, lr) in RUNS.items():
            r = run(base, data, method, lr, 1337 + seed, args.steps)
            results[name].append(r)
            print(f"{name} seed {seed}: {r['before']:.4f} -> {r['after']:.4f}", flush=True)
    summary = {}
    for name, rs in results.items():
        after = [r["after"] for r in rs]
        summary[name] = {
            "before": round(rs[0]["before"], 4),
            "after_mean": round(statistics.mean(after), 4),
            "after_sd": round(statistics.stdev(after), 4) if len(after) > 1 else 0.0,
            "after": [round(a, 4) for a in after],
            "trainable": rs[0]["trainable"],
        }
        print(name, summary[name])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Packed finetuning against one example a row (padded to the step's longest), on the SQL
stage's real batches: real (non-padding) tokens per second of a training step, and the step's
time and shape.

    .venv/bin/python bench/packing.py PROJECT [--steps 6] [--rounds 4] [--dtype bfloat16]
        [--device cuda] [--fresh]

PROJECT is a bench/sql_real.py project (its data/prepared: SmolLM2's tokenizer, Spider's
training pairs; its models/pretrain, or --model: the imported SmolLM2-135M), read with the recipe
configs/smollm2-135m-sql-cpu.yaml's finetune_sql settings (batch 8, max_len 640, replay rows
of pretraining text beside them). Both arms draw from the same examples with the same seeds;
each trains its own copy of the model (AdamW, the recipe's dtype under autocast), the arms
taking turns `--steps` steps at a time (A B A B ...), the first round a warm-up. On a GPU the
packed rows attend through FlexAttention's block mask (moe/model/attention.py
`PACKED_ATTENTION`), and a third arm, `packed-masked`, packs the same rows through SDPA's
boolean mask. Reported per arm: the median step time, real tokens a step, real tokens per
second (the sum over counted steps over their time) and its ratio to unpacked, the shapes
seen. JSON last.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import moe.model.attention as attention  # noqa: E402
from moe.data.tokenizer import load_tokenizer, specials  # noqa: E402
from moe.data.tokens import BatchSampler, MixedBatches, SFTBatches, TokenStore  # noqa: E402
from moe.hf.model_dir import load_model_dir  # noqa: E402
from moe.recipes.finetune import focus_token_ids, sft_examples  # noqa: E402
from moe.recipes.params import read_params  # noqa: E402
from tasks.config import from_dict  # noqa: E402


def real_tokens(batch: tuple) -> int:
    """The batch's tokens that are no padding: a packed batch says so (its segments); an
    unpacked SFT row ends at its last target, and a replay row is all text."""
    if len(batch) > 3:
        return int((batch[3] >= 0).sum())
    y = batch[1].numpy()
    n = 0
    for row in y:
        hit = np.flatnonzero(row != -100)
        n += int(hit[-1]) + 1 if hit.size else 0
    return n


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple, dtype, device) -> None:
    x, y, w, *seg = batch
    rows = torch.from_numpy(np.flatnonzero(y.numpy().reshape(-1) != -100))
    x, y, rows = x.to(device), y.to(device), rows.to(device)
    w = w.to(device) if w is not None else None
    segments = seg[0].to(device) if seg else None
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        _, loss, aux = model(x, y, w, logits=False, loss_rows=rows, segments_BS=segments)
    (loss + aux.balance_loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--steps", type=int, default=6, help="steps per arm per round")
    ap.add_argument("--rounds", type=int, default=4, help="counted rounds (after a warm-up)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--model", type=Path, default=None, help="default PROJECT/models/pretrain (or the import)"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bench/gpu.sh)")
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="PROJECT/params.yaml's own model (at random: the step's cost without carrying"
        " weights) and finetune_sql section, not the SmolLM2 recipe's (bench/gpu.sh, the demo)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    # the recipe's sections as written (its model and Spider folders are the project's here)
    recipe = ROOT / "configs/smollm2-135m-sql-cpu.yaml"
    raw, lines, src = read_params(recipe, ["model.init=", "data.sql_generic_source=generated"])
    cfg = from_dict(raw, lines, src, resolve=False, check_fit=False)
    if args.fresh:  # the project's own sections: its model, its finetune's lengths
        cfg = from_dict(*read_params(args.project / "params.yaml", [])[:3], resolve=False)
    f = cfg.finetune_sql
    d = args.project / "data/prepared"
    tok = load_tokenizer(d / "tokenizer.json")
    sp = specials(tok, d / "tokenizer.json")
    examples = sft_examples(d / "sql/generic.jsonl", tok, sp)
    focus = focus_token_ids(tok, f.focus_tokens)
    if args.fresh:
        from moe.model.transformer import MoETransformer

        shape = dataclasses.replace(cfg.model, seq_len=max(cfg.model.seq_len, f.max_len))
        base = MoETransformer(shape, cfg.moe, tok.get_vocab_size())
    else:
        base = load_model_dir(args.model or args.project / "models/pretrain", torch.float32)
    base.to(device)
    base.set_routing_step(10**6, 0.5)
    dtype = getattr(torch, args.dtype)
    arms = {}
    kinds = [("unpacked", False, "auto"), ("packed", True, "auto")]
    if device.type == "cuda":  # FlexAttention (auto on a GPU) against the boolean mask
        kinds.append(("packed-masked", True, "masked"))
    for name, packing, how in kinds:
        sft = SFTBatches(
            examples, f.batch_size, f.max_len, f.seed, sp.pad, focus, f.focus_weight,
            packing=packing,
        )  # fmt: skip
        rows = max(1, round((sft.rows if packing else f.batch_size) * f.replay_ratio))
        replay = BatchSampler(TokenStore(d, f.replay_split), rows, f.max_len, f.seed + 1)
        model = copy.deepcopy(base).train()
        opt = torch.optim.AdamW(model.parameters(), lr=f.lr, fused=True)  # as the trainer
        arms[name] = dict(batches=MixedBatches(sft, replay), model=model, opt=opt, times=[],
                          tokens=[], shapes=set(), next=0, attention=how)  # fmt: skip
    for r in range(args.rounds + 1):
        for name, a in arms.items():
            attention.PACKED_ATTENTION = a["attention"]
            for _ in range(args.steps):
                batch = a["batches"].batch_at(a["next"])
                a["next"] += 1
                t0 = time.perf_counter()
                step(a["model"], a["opt"], batch, dtype, device)
                dt = time.perf_counter() - t0
                if r:  # the first round warms up
                    a["times"].append(dt)
                    a["tokens"].append(real_tokens(batch))
                    a["shapes"].add(tuple(batch[0].shape))
            print(f"round {r} {name}: {statistics.median(a['times'] or [dt]):.2f} s/step",
                  flush=True)  # fmt: skip
    out = {"steps_counted": args.rounds * args.steps, "dtype": args.dtype, "device": args.device}
    for name, a in arms.items():
        out[name] = {
            "median_step_s": round(statistics.median(a["times"]), 3),
            "real_tokens_per_step": round(statistics.mean(a["tokens"]), 1),
            "real_tokens_per_s": round(sum(a["tokens"]) / sum(a["times"]), 1),
            "shapes": sorted(a["shapes"]),
        }
    out["ratio_real_tokens_per_s"] = round(
        out["packed"]["real_tokens_per_s"] / out["unpacked"]["real_tokens_per_s"], 3
    )
    if "packed-masked" in out:
        out["ratio_flex_over_masked"] = round(
            out["packed"]["real_tokens_per_s"] / out["packed-masked"]["real_tokens_per_s"], 3
        )
    for name in arms:
        o = out[name]
        print(f"{name:13s} {o['median_step_s']:.2f} s/step, {o['real_tokens_per_step']:.0f} real "
              f"tokens/step, {o['real_tokens_per_s']:.0f} real tokens/s, "
              f"{len(o['shapes'])} shape(s)")  # fmt: skip
    print(f"packed / unpacked real tokens per second: {out['ratio_real_tokens_per_s']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

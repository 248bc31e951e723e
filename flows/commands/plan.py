"""`moe-pipeline plan`: per training stage, what each method holds (weights and trainable
state, tasks/fit.py) and, per GPU pool, the GPUs that takes, whether the stage fits as
configured and what an hour costs there."""

from __future__ import annotations

import argparse

from tasks import fit
from tasks.config import load_config


def plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.params, args.overrides, check_fit=False)
    vocab = fit.model_vocab(cfg.model, cfg.tokenizer.vocab_size)
    refused = []
    cur = cfg.cost.currency
    for stage in cfg.training_stages():
        sec = getattr(cfg, stage)
        pool = cfg.pools.stages[stage]
        if stage == "pretrain" and cfg.model.init and cfg.model.init_pretrain == "skip":
            state = fit.needs(cfg.model, cfg.moe, vocab, sec, "full")
            print(
                f"{stage}: skipped (model.init_pretrain: skip): the model passes through, its "
                f"held-out loss measured on pool {pool} ({state.params / 1e9:.2f}B parameters)"
            )
            continue
        print(f"{stage}: pool {pool}, method {sec.method}")
        why = fit.refusal(stage, cfg.model, cfg.moe, vocab, sec, pool, cfg.pools.definitions)
        if why:
            refused.append(why)
        for method in fit.METHODS:
            state = fit.needs(cfg.model, cfg.moe, vocab, sec, method)
            mark = "*" if method == sec.method else " "
            print(
                f"  {mark} {method:5s} {state.trainable / 1e6:10.2f}M trainable"
                f"  {state.weights / 1e9:8.2f} GB weights + {state.trainable_state / 1e9:8.2f}"
                f" GB trainable state + {(state.per_gpu(1) - state.total - state.one_process) / 1e9:6.2f}"
                f" GB activations {fit.signed_gb(state.one_process, 6)} GB under autocast"
                f" = {state.per_gpu(1) / 1e9:7.2f} GB on one GPU"
            )
            for f in fit.pool_fits(state, sec, cfg.pools.definitions):
                print(
                    f"      {f.pool:12s} {f.gpus_needed:3d} GPU(s) {'fits' if f.fits else 'does not fit':12s}"
                    f" {f.per_hour:8.2f} {cur}/h"
                )
    print(
        "A stage fits a pool when a share of the weights and state plus its rows' activations "
        "is within 90% of each GPU (moe/train/memory.py; activations in bf16 on a GPU)."
    )
    for why in refused:  # what `params check` and every stage refuse
        print(f"does not fit: {why}")
    return 2 if refused else 0

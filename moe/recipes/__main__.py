"""A stage's training, or a model's held-out perplexity, without Prefect, DVC or W&B: on a
rented GPU whose image has torch and transformers, the same model folder and checkpoints the
stage writes, resumed the same way.

    python -m moe.recipes pretrain --params params.yaml
    python -m moe.recipes finetune --params params.yaml --stage finetune_sql
    python -m moe.recipes finetune --stage finetune_sql --init models/imported
    python -m moe.recipes perplexity --model models/finetune_sql
    torchrun --nproc_per_node 8 -m moe.recipes pretrain --params params.yaml

The prepared data is data.out_dir's (or --data); a stage's model goes to models/<stage>
(or --out); a finetune starts from the model folder of the stage before it (or --init: any
model folder, `model import`'s included). Exit 2 on bad input, with one line that says what
to change; the last line of a run is its result as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moe.errors import InputError
from moe.recipes.context import RunContext
from moe.recipes.evaluate import held_out_perplexity
from moe.recipes.finetune import FINETUNES, finetune
from moe.recipes.load import check_world, load_params
from moe.recipes.pretrain import pretrain
from moe.train import distributed as D

log = logging.getLogger("moe.recipes")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m moe.recipes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="recipe", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--params", type=Path, default=None, help="params file (./params.yaml)")
    common.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                        help="a params key, e.g. --set finetune_sql.max_steps=60 (repeatable)")  # fmt: skip
    common.add_argument("--data", type=Path, default=None, help="prepared data (data.out_dir)")
    pre = sub.add_parser("pretrain", parents=[common], help="the pretrain stage's training")
    pre.add_argument("--out", type=Path, default=Path("models/pretrain"))
    fin = sub.add_parser("finetune", parents=[common], help="a finetune stage's training")
    fin.add_argument("--stage", choices=sorted(FINETUNES), required=True, help="its params section")
    fin.add_argument("--init", type=Path, default=None, help="the model folder to start from")
    fin.add_argument("--pairs", default=None, help="pairs file under DATA/sql/")
    fin.add_argument("--out", type=Path, default=None, help="models/STAGE")
    ppl = sub.add_parser("perplexity", parents=[common], help="a model's held-out perplexity")
    ppl.add_argument("--model", type=Path, required=True, help="a model folder")
    return ap


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe `args` names, in this process (or as this rank of torchrun)."""
    params = load_params(args.params, args.overrides)
    data = args.data or Path(params.data.out_dir)
    if not (data / "meta.json").is_file():
        raise InputError(f"{data}: no prepared data here (meta.json): run prepare, or give --data")
    if args.recipe == "perplexity":
        return held_out_perplexity(params, data, args.model)
    ctx = RunContext(log_fn=lambda row: None)
    if args.recipe == "pretrain":
        return dataclasses.asdict(pretrain(params, data, args.out, ctx))
    pairs, before = FINETUNES[args.stage]
    init = args.init or Path("models") / before
    out = args.out or Path("models") / args.stage
    result = finetune(params, args.stage, data, args.pairs or pairs, init, out, ctx)
    return dataclasses.asdict(result)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if ranks > 1:  # under torchrun: every rank runs the recipe, checked for as many
            stage = args.stage if args.recipe == "finetune" else "pretrain"
            params = load_params(args.params, args.overrides)
            check_world(params, stage, ranks)
            D.init(timeout_s=300, device=getattr(params, stage).device)
        result = run(args)
    except InputError as e:  # the user's input: one line, exit 2
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a training stage under torchrun (started by `tasks.launch.torchrun`).

`python -m torch.distributed.run --standalone --nproc_per_node N -m tasks.dist_entry
 STAGE PARAMS_YAML DATA_DIR OUT_DIR [INIT_DIR PAIRS_FILE BUDGET_LEFT]`
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

import tasks

tasks.offline_defaults()  # before Prefect and W&B read their settings
from moe.errors import InputError  # noqa: E402
from moe.train import distributed as D  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.finetuning import finetune_model  # noqa: E402
from tasks.launch import INPUT_ERROR  # noqa: E402
from tasks.pretraining import pretrain_model  # noqa: E402


def main(argv: list[str]) -> int:
    stage, params, data_dir, out_dir = argv[0], Path(argv[1]), Path(argv[2]), Path(argv[3])
    init_dir = Path(argv[4]) if len(argv) > 4 and argv[4] else None
    pairs_file = argv[5] if len(argv) > 5 else ""
    budget_left = float(argv[6]) if len(argv) > 6 else 0.0
    cfg = load_config(params)
    device = cfg.pretrain.device if stage == "pretrain" else getattr(cfg, stage).device
    rank, _ = D.init(timeout_s=300, device=device)
    refused = out_dir / ".dist" / INPUT_ERROR
    try:
        if stage == "pretrain":
            result = pretrain_model.fn(cfg, data_dir, out_dir, lambda row: None, budget_left)
        else:
            result = finetune_model.fn(
                cfg, stage, data_dir, pairs_file, init_dir, out_dir, lambda row: None, budget_left
            )
        if rank == 0:
            (out_dir / ".dist" / "result.json").write_text(json.dumps(asdict(result)))
    except InputError as e:  # the user's input, not a crash: one line, exit 2, no retry
        print(f"error: {e}", file=sys.stderr, flush=True)
        if rank == 0:
            refused.parent.mkdir(parents=True, exist_ok=True)
            refused.write_text(str(e))
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`moe-pipeline`: validate params, run a stage or the whole pipeline, inspect checkpoints.

Every command validates the configuration first: a bad key, type or value exits with code 2
and a message naming the key, before any work and without touching existing outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import flows  # noqa: F401 - offline defaults before Prefect is imported
from moe.config import STAGES, ConfigError, load_config
from moe.errors import InputError

EXIT_CONFIG = 2  # bad configuration or input: nothing was run or written


def _add_params(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        metavar="FILE",
        default=None,
        help="params file (default: ./params.yaml, else the embedded default)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one key, e.g. --set train.lr=3e-4 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-pipeline", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    params = sub.add_parser("params", help="check or show the configuration")
    psub = params.add_subparsers(dest="params_command", required=True)
    check = psub.add_parser("check", help="validate a params file (exit 2 on problems)")
    check.add_argument("file", nargs="?", default=None)
    check.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[])
    show = psub.add_parser("show", help="print the resolved configuration")
    show.add_argument("file", nargs="?", default=None)
    show.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[])

    stage = sub.add_parser("stage", help="run one stage's flow in this process")
    stage.add_argument("name", choices=STAGES)
    _add_params(stage)

    run = sub.add_parser("run", help="run the whole pipeline in this process")
    run.add_argument(
        "--stages",
        nargs="+",
        choices=STAGES,
        default=None,
        help="only these stages (in pipeline order)",
    )
    _add_params(run)

    ckpt = sub.add_parser("checkpoint", help="inspect checkpoints")
    csub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    digest = csub.add_parser(
        "digest", help="sha256 of the model weights of the newest valid checkpoint under DIR"
    )
    digest.add_argument("dir", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "params":
            cfg = load_config(args.file, args.overrides)
            if args.params_command == "check":
                src = args.file or (
                    "params.yaml" if Path("params.yaml").is_file() else "embedded default"
                )
                print(f"{src}: OK")
            else:
                import yaml

                print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if args.command == "checkpoint":
            return _digest(args.dir)
        load_config(
            args.params, args.overrides
        )  # validate before importing Prefect or touching anything
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG

    try:
        if args.command == "stage":
            from flows.stages import STAGE_FLOWS

            STAGE_FLOWS[args.name](args.params, args.overrides)
            _where(args.name)
        elif args.command == "run":
            from flows.pipeline import pipeline

            pipeline(args.params, args.overrides, args.stages)
            _where("evaluate" if not args.stages or "evaluate" in args.stages else args.stages[-1])
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def _where(stage: str) -> None:
    places = {
        "prepare": "data/prepared/",
        "publish": "data/published/receipt.json",
        "pretrain": "models/pretrain/ (metrics: reports/pretrain.json)",
        "finetune_sql": "models/finetune_sql/ (metrics: reports/finetune_sql.json)",
        "finetune_domain": "models/finetune_domain/ (metrics: reports/finetune_domain.json)",
        "evaluate": "reports/metrics.json, reports/cost.json, reports/evaluate/report.md",
    }
    print(f"{stage} done: {places[stage]}")


def _digest(root: Path) -> int:
    from moe.checkpoint import CheckpointStore, weights_digest

    for candidate in (root, root / "checkpoints"):
        path = CheckpointStore(candidate).latest_valid()
        if path is not None:
            print(f"{weights_digest(CheckpointStore(candidate).load(path).model)}  {path}")
            return 0
    print(
        f"error: no valid checkpoint under {root} (nor under {root / 'checkpoints'})",
        file=sys.stderr,
    )
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())

"""`moe-pipeline`: validate params, run a stage or the whole pipeline, inspect checkpoints.

Every command validates the configuration first: a bad key, type or value exits with code 2
and a message naming the key, before any work and without touching existing outputs.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flows  # noqa: F401 - offline defaults before Prefect is imported
from flows.commands import EXIT_CONFIG, outputs, plan, server
from moe.errors import InputError
from tasks.config import Config, load_config
from tasks.pools import STAGES

Handler = Callable[[argparse.Namespace], int]
Arg = tuple[tuple[str, ...], dict[str, Any]]  # add_argument's positional and keyword arguments


# --------------------------------------------------------------------------- params, stage, run


def params_check(args: argparse.Namespace) -> int:
    load_config(args.file, args.overrides)
    src = args.file or ("params.yaml" if Path("params.yaml").is_file() else "embedded default")
    print(f"{src}: OK")
    return 0


def params_show(args: argparse.Namespace) -> int:
    import yaml

    cfg = load_config(args.file, args.overrides)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


# Both validate the params and what the stages need before importing Prefect or touching
# anything: bad input is one message and exit 2, never a flow run's traceback.
def run_stage(args: argparse.Namespace) -> int:
    preflight(load_config(args.params, args.overrides), [args.name])
    _force(args)
    from flows.stages import STAGE_FLOWS

    STAGE_FLOWS[args.name](params_file=args.params, overrides=args.overrides)
    _where(args.name)
    return 0


def run_pipeline(args: argparse.Namespace) -> int:
    preflight(load_config(args.params, args.overrides), args.stages or STAGES)
    _force(args)
    from flows.pipeline import pipeline

    pipeline(stages=args.stages, params_file=args.params, overrides=args.overrides)
    _where("evaluate" if not args.stages or "evaluate" in args.stages else args.stages[-1])
    return 0


def _force(args: argparse.Namespace) -> None:
    if args.force:
        os.environ["MOE_FORCE"] = "1"


# What each stage reads that an earlier stage writes (local paths, as dvc.yaml lists them).
def preflight(cfg: Config, stages: list[str] | tuple[str, ...]) -> None:
    """Raise InputError for what the stages need and cannot get: a corpus with no readable
    text, or an upstream output that no stage of this run makes and that is missing or no
    longer matches the hash its stage's lineage record holds."""
    from flows.stage import published_is_prepared
    from flows.stages import STAGES_BY_NAME
    from moe.data.sources import check_source

    if "prepare" in stages:
        d = cfg.data
        check_source(d.source, d.text_field, d.on_bad_record, d.encoding, d.doc_max_bytes)
    for stage in stages:
        for path, producer in STAGES_BY_NAME[stage].reads(cfg):
            if producer in stages:  # made earlier in this run
                continue
            if not path.is_file():
                raise InputError(
                    f"stage {stage} needs {path}, which is missing: run the {producer} stage "
                    f"first (moe-pipeline stage {producer}, or dvc repro)"
                )
            _verify_against_lineage(path, producer, stage)
    readers = [s for s in stages if any(p == "publish" for _, p in STAGES_BY_NAME[s].reads(cfg))]
    published_is_prepared(cfg, readers, stages)


def _verify_against_lineage(path: Path, producer: str, stage: str) -> None:
    """`path` still has the sha256 its producer's lineage record holds (where it has one)."""
    import json

    record = path.parent / "lineage.json"
    if path.suffix != ".safetensors" or not record.is_file():
        return
    try:
        outputs = json.loads(record.read_text()).get("outputs", {})
    except (OSError, ValueError):
        return
    want = next((o["sha256"] for o in outputs.values() if Path(o["path"]) == path), None)
    if want is None:
        return
    from moe.hashing import sha256_file  # a file's hash, as the lineage record took it

    if sha256_file(path) != want:
        raise InputError(
            f"stage {stage} needs {path}, which changed since the {producer} stage wrote it "
            f"(its sha256 no longer matches {record}): run {producer} again "
            f"(moe-pipeline stage {producer} --force) or restore the file (dvc checkout)"
        )


def _where(stage: str) -> None:
    from flows.stages import STAGES_BY_NAME

    print(f"{stage} done: {STAGES_BY_NAME[stage].done}")


# --------------------------------------------------------------------------- the commands


@dataclass(frozen=True)
class Command:
    """One command: a leaf runs `handler` with the parsed arguments; a group (no handler)
    holds `sub` commands, one of which is required."""

    name: str
    help: str | None
    handler: Handler | None = None
    args: tuple[Arg, ...] = ()
    sub: tuple[Command, ...] = ()


def arg(*flags: str, **kw: Any) -> Arg:
    return flags, kw


PARAMS = (
    arg(
        "--params",
        metavar="FILE",
        default=None,
        help="params file (default: ./params.yaml, else the embedded default)",
    ),
    arg(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one key, e.g. --set pretrain.lr=3e-4 (repeatable)",
    ),
)
FORCE = arg(
    "--force",
    action="store_true",
    help="run even a stage whose params, code and inputs did not change since it ran "
    "(default: such a stage is skipped and says so; MOE_FORCE=1 does the same)",
)
SET = arg("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[])
ROOT = arg("--root", type=Path, default=Path("."), help="the project folder")
DIR = arg("dir", type=Path)
OUT = arg("--out", type=Path, required=True)
POOL_ARGS = (
    arg("--type", choices=["process", "docker", "kubernetes"], required=True),
    arg("--image-tag", default="", help="image tag instead of the tier's (e.g. the commit)"),
    *PARAMS,
)

COMMANDS = (
    Command(
        "params",
        "check or show the configuration",
        sub=(
            Command(
                "check",
                "validate a params file (exit 2 on problems)",
                params_check,
                (arg("file", nargs="?", default=None), SET),
            ),
            Command(
                "show",
                "print the resolved configuration",
                params_show,
                (arg("file", nargs="?", default=None), SET),
            ),
        ),
    ),
    Command(
        "stage",
        "run one stage's flow in this process",
        run_stage,
        (arg("name", choices=STAGES), *PARAMS, FORCE),
    ),
    Command(
        "run",
        "run the whole pipeline in this process",
        run_pipeline,
        (
            arg(
                "--stages",
                nargs="+",
                choices=STAGES,
                default=None,
                help="only these stages (in pipeline order)",
            ),
            *PARAMS,
            FORCE,
        ),
    ),
    Command(
        "plan",
        "per training stage and method: the memory it holds and the GPUs of each pool it takes",
        plan.plan,
        PARAMS,
    ),
    Command(
        "lineage",
        "walk an output (file or folder) back through the stages to its corpus",
        outputs.lineage,
        (
            arg("output", type=Path),
            ROOT,
            arg("--json", action="store_true", help="the chain as JSON"),
        ),
    ),
    Command(
        "stack",
        "the local stack: Prefect server, S3 (moto), a worker per pool, the deployments",
        sub=(
            Command(
                "up",
                "start what is not running (idempotent)",
                server.stack_up,
                (
                    arg("--params", metavar="FILE", default=None, help="whose pools to create"),
                    arg("--no-ui", action="store_true", help="serve the API without the web UI"),
                    ROOT,
                ),
            ),
            Command(
                "status",
                "each process of the stack and each pool's workers",
                server.stack_status,
                (ROOT,),
            ),
            Command("down", "stop exactly the processes `up` started", server.stack_down, (ROOT,)),
            Command(
                "watch",
                "restart a worker that dies or fails its health check (`up` starts it)",
                server.stack_watch,
                (ROOT,),
            ),
            Command(
                "run",
                "run the pipeline deployment: each stage on its pool's worker",
                server.stack_run,
                (
                    arg("--stages", nargs="+", choices=STAGES, default=None),
                    arg(
                        "--handoff",
                        default=None,
                        help="an earlier run's hand-off key (re-run later stages)",
                    ),
                    *PARAMS,
                    ROOT,
                ),
            ),
        ),
    ),
    Command(
        "pools",
        "work pools with per-pool job templates (GPUs, memory, image, volume)",
        sub=(
            Command(
                "create",
                "create or update every pool of pools.definitions on the server of "
                "PREFECT_API_URL, each with its own job template",
                server.pools_create,
                POOL_ARGS,
            ),
            Command(
                "template",
                "print one pool's job template (for prefect work-pool create)",
                server.pools_template,
                (arg("pool"), *POOL_ARGS),
            ),
        ),
    ),
    Command(
        "recovery",
        "the automations that crash a run whose machine vanished and run the stage again",
        sub=(
            Command(
                "install",
                "create (or replace) them on the server of PREFECT_API_URL (yours, or Prefect "
                "Cloud); needs the deployments of prefect.yaml (the recover deployment)",
                server.recovery_install,
                PARAMS,
            ),
        ),
    ),
    Command(
        "deployments",
        "what the deployments on a server need beyond prefect.yaml",
        sub=(
            Command(
                "configure",
                "after `prefect deploy --all`: the run forms' defaults (every stage, params as "
                "this params file resolves) on the server of PREFECT_API_URL",
                server.deployments_configure,
                PARAMS,
            ),
        ),
    ),
    Command(
        "alerts",
        "route the pipeline's events to a notification block",
        sub=(
            Command(
                "install",
                "create (or replace) the automation that sends each budget alert "
                "(moe.budget.alert) to a notification block on the server of PREFECT_API_URL",
                server.alerts_install,
                (
                    arg(
                        "--block",
                        required=True,
                        help="the notification block, as TYPE/NAME (e.g. "
                        "slack-webhook/moe-alerts: create it in the UI's Blocks page or with "
                        "SlackWebhook(url=...).save('moe-alerts'))",
                    ),
                    arg(
                        "--events",
                        nargs="+",
                        default=None,
                        help="the events to send (default: moe.budget.alert; all: "
                        "tasks/events.py EVENTS)",
                    ),
                ),
            ),
        ),
    ),
    # digest, restore and export: --params names the storage that offloaded or other
    # nodes' files are fetched from
    Command(
        "checkpoint",
        "inspect checkpoints",
        sub=(
            Command(
                "digest",
                "sha256 of the model weights of the newest valid checkpoint under DIR",
                outputs.checkpoint_digest,
                (DIR, *PARAMS),
            ),
            Command(
                "ls",
                "each checkpoint under DIR: step, size, tiers, valid or not",
                outputs.checkpoint_ls,
                (DIR,),
            ),
            Command(
                "verify",
                "check every checkpoint's hashes (and its bases'); exit 1 if one fails",
                outputs.checkpoint_ls,
                (DIR,),
            ),
            Command(
                "restore",
                "write the model weights of one checkpoint to a safetensors file",
                outputs.checkpoint_restore,
                (
                    DIR,
                    *PARAMS,
                    arg("--step", type=int, default=None, help="default: the newest valid"),
                    OUT,
                ),
            ),
            Command(
                "export",
                "the newest valid checkpoint's model weights as one safetensors file",
                outputs.checkpoint_restore,
                (DIR, *PARAMS, OUT),
            ),
        ),
    ),
    Command(
        "model",
        "Hugging Face models in and out",
        sub=(
            Command(
                "import",
                "a local Hugging Face folder (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, "
                "ERNIE-4.5-MoE; Llama, Qwen2, Qwen3 upcycled to moe.num_experts) as a model "
                "folder model.init takes",
                outputs.model_import,
                (DIR, OUT, *PARAMS),
            ),
            Command(
                "export",
                "a model folder (a stage's or an import) as a folder transformers and vLLM load",
                outputs.model_export,
                (
                    DIR,
                    OUT,
                    arg(
                        "--data",
                        type=Path,
                        default=None,
                        help="the prepared data (its tokenizer); default data.out_dir",
                    ),
                    arg(
                        "--arch",
                        default="",
                        help="prefer this architecture (qwen3_moe, qwen2_moe, mixtral, olmoe, "
                        "ernie4_5_moe) when it represents the model exactly",
                    ),
                    *PARAMS,
                ),
            ),
        ),
    ),
    Command(
        "ask",
        "the SQL a model writes for a question, and its rows",
        outputs.answer,
        (
            arg("dir", type=Path, help="a model folder (e.g. models/finetune_domain)"),
            arg("question"),
            # a str: a URL's // would not survive Path
            arg("--db", required=True, help="the database to ask: a sqlite file or a server's URL"),
            arg("--data", type=Path, default=None, help="the prepared data (its tokenizer)"),
            arg("--rows", type=int, default=20, help="rows to print (default 20)"),
            arg("--candidates", type=int, default=0, help="answers to vote over (1: greedy)"),
            *PARAMS,
        ),
    ),
)


def _add(parent: argparse._SubParsersAction, command: Command) -> None:
    p = parent.add_parser(command.name, help=command.help)
    for flags, kw in command.args:
        p.add_argument(*flags, **copy.deepcopy(kw))  # a parser's own defaults ([] for --set)
    if command.sub:
        sub = p.add_subparsers(dest=f"{command.name}_command", required=True)
        for c in command.sub:
            _add(sub, c)
    else:
        p.set_defaults(handler=command.handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-pipeline", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        _add(sub, command)
    return parser


def exit_on_sigterm() -> None:
    """A SIGTERM ends the command as an exit does, not as the default action does: atexit
    runs, so Prefect's temporary server (no PREFECT_API_URL) and W&B's service process
    stop with it instead of running on, orphaned. Inside a flow run Prefect's own handler
    acts first, then gives the signal to this one."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the command itself (`moe-pipeline`, `python -m flows.cli`), not a test
        exit_on_sigterm()
    try:
        return args.handler(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())

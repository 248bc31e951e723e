"""moe-pipeline: MoE and dense models finetuned for text-to-SQL on your database, with cost and lineage.

Every command validates the configuration first: a bad key, type or value exits with code 2
and a message naming the key, before any work and without touching existing outputs.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flows  # noqa: F401 - offline defaults before Prefect is imported
from flows.commands import EXIT_CONFIG, arch_help, import_help
from moe.errors import InputError
from tasks.pools import STAGES

# A handler, or where one lives ("module:function"), imported when its command runs: the
# CLI answers --help, params explain, lineage and stack status without importing torch.
Handler = Callable[[argparse.Namespace], int] | str
Arg = tuple[tuple[str, ...], dict[str, Any]]  # add_argument's positional and keyword arguments


# --------------------------------------------------------------------------- the commands


@dataclass(frozen=True)
class Command:
    """One command: a leaf runs `handler` with the parsed arguments; a group (no handler)
    holds `sub` commands, one of which is required. `help` may be a function that reads a
    registry: it is called only when the command is on the line being parsed."""

    name: str
    help: str | Callable[[], str]
    handler: Handler | None = None
    args: tuple[Arg, ...] = ()
    sub: tuple[Command, ...] = ()
    short: str = ""  # the group listing's line when `help` is a function


def arg(*flags: str, **kw: Any) -> Arg:
    return flags, kw


PARAMS_FILE = arg(
    "--params",
    metavar="FILE",
    default=None,
    help="params file laid over the defaults, e.g. configs/NAME.yaml (default: ./params.yaml, "
    "else the embedded default)",
)
SET = arg(
    "--set",
    dest="overrides",
    metavar="KEY=VALUE",
    action="append",
    default=[],
    help="override one key, e.g. --set finetune_sql.lr=3e-4 (repeatable)",
)
PARAMS = (PARAMS_FILE, SET)
# `params check FILE`, as it was spelled: refused with the spelling every command takes
OLD_FILE = arg("file", nargs="?", default=None, help=argparse.SUPPRESS)
FORCE = arg(
    "--force",
    action="store_true",
    help="run even a stage whose params, code and inputs did not change since it ran "
    "(default: such a stage is skipped and says so; MOE_FORCE=1 does the same)",
)
ROOT = arg("--root", type=Path, default=Path("."), help="the project folder (default: .)")
CKPT_DIR = arg("dir", type=Path, help="a stage's model folder or checkpoint folder")
OUT = arg("--out", type=Path, required=True, help="where to write")
POOL_ARGS = (
    arg(
        "--type",
        choices=["process", "docker", "kubernetes"],
        required=True,
        help="the Prefect worker type the pools are created for",
    ),
    arg("--image-tag", default="", help="image tag instead of the tier's (e.g. the commit)"),
    *PARAMS,
)
STAGES_ARG = arg(
    "--stages", nargs="+", choices=STAGES, default=None, help="only these stages (in order)"
)


EXAMPLES = """examples:
  moe-pipeline configs                                  the recipes: one per model and method
  moe-pipeline plan --params configs/qwen3-30b-a3b-lora-80gb.yaml
                                                        memory and pools before renting a GPU
  moe-pipeline run --params configs/smollm2-135m-sql-cpu.yaml
  moe-pipeline run --set data.sql_domain_database=shop.sqlite
  moe-pipeline params explain finetune_sql.max_len      what a key means, its range, default
  moe-pipeline ask models/finetune_domain "How many customers are there?" --db shop.sqlite

Every command checks the params first: a bad key exits 2 naming it, before any work."""

COMMANDS = (
    Command(
        "params",
        "check, show, explain or write the configuration",
        sub=(
            Command(
                "check",
                "validate the params (exit 2 naming every problem)",
                "flows.commands.params:check",
                (*PARAMS, OLD_FILE),
            ),
            Command(
                "show",
                "print the resolved configuration",
                "flows.commands.params:show",
                (*PARAMS, OLD_FILE),
            ),
            Command(
                "explain",
                "what a key means (from where it is declared), its range and its default",
                "flows.commands.params:explain",
                (arg("key", help="a dotted key, e.g. finetune_sql.lr, or a section, e.g. moe"),),
            ),
            Command(
                "write",
                "write a params file with every key commented: the defaults, or a recipe laid "
                "over them (for dvc exp run)",
                "flows.commands.params:write",
                (
                    *PARAMS,
                    arg("--out", default="params.yaml", help="the file (default: params.yaml)"),
                    arg(
                        "--force",
                        action="store_true",
                        help="replace a file that holds other params than the defaults",
                    ),
                ),
            ),
        ),
    ),
    Command(
        "configs",
        "list the recipes in configs/ (one params file per model and method)",
        "flows.commands.params:configs",
    ),
    Command(
        "stage",
        "run one stage's flow in this process",
        "flows.commands.run:run_stage",
        (arg("name", choices=STAGES, help="the stage"), *PARAMS, FORCE),
    ),
    Command(
        "run",
        "run the whole pipeline in this process",
        "flows.commands.run:run_pipeline",
        (STAGES_ARG, *PARAMS, FORCE),
    ),
    Command(
        "plan",
        "per training stage and method: the memory it holds and the GPUs of each pool it takes",
        "flows.commands.plan:plan",
        PARAMS,
    ),
    Command(
        "lineage",
        "walk an output (file or folder) back through the stages to its corpus",
        "flows.commands.outputs:lineage",
        (
            arg("output", type=Path, help="a file or folder a stage wrote"),
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
                "flows.commands.server:stack_up",
                (
                    arg("--params", metavar="FILE", default=None, help="whose pools to create"),
                    arg("--no-ui", action="store_true", help="serve the API without the web UI"),
                    ROOT,
                ),
            ),
            Command(
                "status",
                "each process of the stack and each pool's workers",
                "flows.commands.server:stack_status",
                (ROOT,),
            ),
            Command(
                "down",
                "stop exactly the processes `up` started",
                "flows.commands.server:stack_down",
                (ROOT,),
            ),
            Command(
                "watch",
                "restart a worker that dies or fails its health check (`up` starts it)",
                "flows.commands.server:stack_watch",
                (ROOT,),
            ),
            Command(
                "run",
                "run the pipeline deployment: each stage on its pool's worker",
                "flows.commands.server:stack_run",
                (
                    STAGES_ARG,
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
                "flows.commands.server:pools_create",
                POOL_ARGS,
            ),
            Command(
                "template",
                "print one pool's job template (for prefect work-pool create)",
                "flows.commands.server:pools_template",
                (arg("pool", help="a pool of pools.definitions"), *POOL_ARGS),
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
                "flows.commands.server:recovery_install",
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
                "flows.commands.server:deployments_configure",
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
                "flows.commands.server:alerts_install",
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
                "flows.commands.outputs:checkpoint_digest",
                (CKPT_DIR, *PARAMS),
            ),
            Command(
                "ls",
                "each checkpoint under DIR: step, size, tiers, valid or not",
                "flows.commands.outputs:checkpoint_ls",
                (CKPT_DIR,),
            ),
            Command(
                "verify",
                "check every checkpoint's hashes (and its bases'); exit 1 if one fails",
                "flows.commands.outputs:checkpoint_ls",
                (CKPT_DIR,),
            ),
            Command(
                "restore",
                "write the model weights of one checkpoint to a safetensors file",
                "flows.commands.outputs:checkpoint_restore",
                (
                    CKPT_DIR,
                    *PARAMS,
                    arg("--step", type=int, default=None, help="default: the newest valid"),
                    OUT,
                ),
            ),
            Command(
                "export",
                "the newest valid checkpoint's model weights as one safetensors file",
                "flows.commands.outputs:checkpoint_restore",
                (CKPT_DIR, *PARAMS, OUT),
            ),
        ),
    ),
    Command(
        "model",
        "Hugging Face models in and out",
        sub=(
            Command(
                "import",
                import_help,
                "flows.commands.outputs:model_import",
                (
                    arg("dir", type=Path, help="the Hugging Face folder (config.json, weights)"),
                    OUT,
                    *PARAMS,
                ),
                short="a local Hugging Face folder as a model folder model.init takes",
            ),
            Command(
                "export",
                "a model folder (a stage's or an import) as a folder transformers and vLLM load",
                "flows.commands.outputs:model_export",
                (
                    arg("dir", type=Path, help="a model folder (e.g. models/finetune_domain)"),
                    OUT,
                    arg(
                        "--data",
                        type=Path,
                        default=None,
                        help="the prepared data (its tokenizer); default data.out_dir",
                    ),
                    arg("--arch", default="", help=arch_help),
                    *PARAMS,
                ),
            ),
        ),
    ),
    Command(
        "ask",
        "the SQL a model writes for a question, and its rows",
        "flows.commands.outputs:answer",
        (
            arg("dir", type=Path, help="a model folder (e.g. models/finetune_domain)"),
            arg("question", help="the question, in words"),
            # a str: a URL's // would not survive Path
            arg("--db", required=True, help="the database to ask: a sqlite file or a server's URL"),
            arg("--data", type=Path, default=None, help="the prepared data (its tokenizer)"),
            arg("--rows", type=int, default=20, help="rows to print (default 20)"),
            arg("--candidates", type=int, default=0, help="answers to vote over (1: greedy)"),
            *PARAMS,
        ),
    ),
)


def _text(help: str | Callable[[], str], on_path: bool, short: str) -> str:
    if callable(help):
        return help() if on_path else short
    return help


def _add(parent: argparse._SubParsersAction, command: Command, path: list[str], depth: int) -> None:
    on_path = len(path) > depth and path[depth] == command.name
    p = parent.add_parser(
        command.name,
        help=_text(command.help, on_path and len(path) > depth, command.short),
        description=_text(command.help, on_path, command.short),
    )
    for flags, kw in command.args:
        kw = copy.deepcopy(kw)  # a parser's own defaults ([] for --set)
        if callable(kw.get("help")):
            kw["help"] = kw["help"]() if on_path else "see this command's --help"
        p.add_argument(*flags, **kw)
    if command.sub:
        sub = p.add_subparsers(dest=f"{command.name}_command", required=True)
        for c in command.sub:
            _add(sub, c, path if on_path else [], depth + 1)
    else:
        p.set_defaults(handler=command.handler)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moe-pipeline")
    except PackageNotFoundError:  # run from a checkout without installing
        return "unknown (not installed: pip install -e .)"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; `argv` (the line being parsed) says which commands' registry-read help
    texts to build (they import the model families, and torch)."""
    parser = argparse.ArgumentParser(
        prog="moe-pipeline",
        description=__doc__.split("\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    path = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    for command in COMMANDS:
        _add(sub, command, path, 0)
    return parser


def resolve(handler: Handler) -> Callable[[argparse.Namespace], int]:
    """The handler itself, importing its module where it is named as "module:function"."""
    if isinstance(handler, str):
        module, _, name = handler.partition(":")
        return getattr(importlib.import_module(module), name)
    return handler


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
    args = build_parser(argv).parse_args(argv)
    if argv is None:  # the command itself (`moe-pipeline`, `python -m flows.cli`), not a test
        exit_on_sigterm()
    try:
        return resolve(args.handler)(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())

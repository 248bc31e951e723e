"""`moe-pipeline`: validate params, run a stage or the whole pipeline, inspect checkpoints.

Every command validates the configuration first: a bad key, type or value exits with code 2
and a message naming the key, before any work and without touching existing outputs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import flows  # noqa: F401 - offline defaults before Prefect is imported
from moe.errors import InputError
from tasks.config import STAGES, Config, load_config

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
        help="override one key, e.g. --set pretrain.lr=3e-4 (repeatable)",
    )


def _add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="run even a stage whose params, code and inputs did not change since it ran "
        "(default: such a stage is skipped and says so; MOE_FORCE=1 does the same)",
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
    _add_force(stage)

    run = sub.add_parser("run", help="run the whole pipeline in this process")
    run.add_argument(
        "--stages",
        nargs="+",
        choices=STAGES,
        default=None,
        help="only these stages (in pipeline order)",
    )
    _add_params(run)
    _add_force(run)

    lineage = sub.add_parser(
        "lineage", help="walk an output (file or folder) back through the stages to its corpus"
    )
    lineage.add_argument("output", type=Path)
    lineage.add_argument("--root", type=Path, default=Path("."), help="the project folder")
    lineage.add_argument("--json", action="store_true", help="the chain as JSON")

    stack = sub.add_parser(
        "stack",
        help="the local stack: Prefect server, S3 (moto), a worker per pool, the deployments",
    )
    ssub = stack.add_subparsers(dest="stack_command", required=True)
    sup = ssub.add_parser("up", help="start what is not running (idempotent)")
    sup.add_argument("--params", metavar="FILE", default=None, help="whose pools to create")
    sup.add_argument("--no-ui", action="store_true", help="serve the API without the web UI")
    ssub.add_parser("status", help="each process of the stack and each pool's workers")
    ssub.add_parser("down", help="stop exactly the processes `up` started")
    ssub.add_parser(
        "watch", help="restart a worker that dies or fails its health check (`up` starts it)"
    )
    srun = ssub.add_parser(
        "run", help="run the pipeline deployment: each stage on its pool's worker"
    )
    srun.add_argument("--stages", nargs="+", choices=STAGES, default=None)
    srun.add_argument(
        "--handoff", default=None, help="an earlier run's hand-off key (re-run later stages)"
    )
    _add_params(srun)
    for p in ssub.choices.values():
        p.add_argument("--root", type=Path, default=Path("."), help="the project folder")

    pools = sub.add_parser(
        "pools", help="work pools with per-pool job templates (GPUs, memory, image, volume)"
    )
    posub = pools.add_subparsers(dest="pools_command", required=True)
    pcreate = posub.add_parser(
        "create",
        help="create or update every pool of pools.definitions on the server of "
        "PREFECT_API_URL, each with its own job template",
    )
    ptemplate = posub.add_parser(
        "template", help="print one pool's job template (for prefect work-pool create)"
    )
    ptemplate.add_argument("pool")
    for p in (pcreate, ptemplate):
        p.add_argument("--type", choices=["process", "docker", "kubernetes"], required=True)
        p.add_argument(
            "--image-tag", default="", help="image tag instead of the tier's (e.g. the commit)"
        )
        _add_params(p)

    recovery = sub.add_parser(
        "recovery",
        help="the automations that crash a run whose machine vanished and run the stage again",
    )
    rsub = recovery.add_subparsers(dest="recovery_command", required=True)
    rinst = rsub.add_parser(
        "install",
        help="create (or replace) them on the server of PREFECT_API_URL (yours, or Prefect "
        "Cloud); needs the deployments of prefect.yaml (the recover deployment)",
    )
    _add_params(rinst)

    deps = sub.add_parser(
        "deployments", help="what the deployments on a server need beyond prefect.yaml"
    )
    dsub = deps.add_subparsers(dest="deployments_command", required=True)
    dconf = dsub.add_parser(
        "configure",
        help="after `prefect deploy --all`: the run forms' defaults (every stage, params as "
        "this params file resolves) on the server of PREFECT_API_URL",
    )
    _add_params(dconf)
    alerts = sub.add_parser("alerts", help="route the pipeline's events to a notification block")
    asub = alerts.add_subparsers(dest="alerts_command", required=True)
    ainst = asub.add_parser(
        "install",
        help="create (or replace) the automation that sends each budget alert "
        "(moe.budget.alert) to a notification block on the server of PREFECT_API_URL",
    )
    ainst.add_argument(
        "--block",
        required=True,
        help="the notification block, as TYPE/NAME (e.g. slack-webhook/moe-alerts: create it "
        "in the UI's Blocks page or with SlackWebhook(url=...).save('moe-alerts'))",
    )
    ainst.add_argument(
        "--events",
        nargs="+",
        default=None,
        help="the events to send (default: moe.budget.alert; all: tasks/events.py EVENTS)",
    )

    ckpt = sub.add_parser("checkpoint", help="inspect checkpoints")
    csub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    digest = csub.add_parser(
        "digest", help="sha256 of the model weights of the newest valid checkpoint under DIR"
    )
    digest.add_argument("dir", type=Path)
    _add_params(digest)  # the storage that offloaded or other nodes' files are fetched from
    ls = csub.add_parser("ls", help="each checkpoint under DIR: step, size, tiers, valid or not")
    ls.add_argument("dir", type=Path)
    verify = csub.add_parser(
        "verify", help="check every checkpoint's hashes (and its bases'); exit 1 if one fails"
    )
    verify.add_argument("dir", type=Path)
    restore = csub.add_parser(
        "restore", help="write the model weights of one checkpoint to a safetensors file"
    )
    restore.add_argument("dir", type=Path)
    _add_params(restore)  # the storage that offloaded or other nodes' files are fetched from
    restore.add_argument("--step", type=int, default=None, help="default: the newest valid")
    restore.add_argument("--out", type=Path, required=True)
    export = csub.add_parser(
        "export", help="the newest valid checkpoint's model weights as one safetensors file"
    )
    export.add_argument("dir", type=Path)
    _add_params(export)  # the storage that offloaded or other nodes' files are fetched from
    export.add_argument("--out", type=Path, required=True)

    model = sub.add_parser("model", help="Hugging Face models in and out")
    msub = model.add_subparsers(dest="model_command", required=True)
    mimport = msub.add_parser(
        "import",
        help="a local Hugging Face folder (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, ERNIE-4.5-MoE;"
        " Llama, Qwen2, Qwen3 upcycled to moe.num_experts) as a model folder model.init takes",
    )
    mimport.add_argument("dir", type=Path)
    mimport.add_argument("--out", type=Path, required=True)
    _add_params(mimport)
    mexport = msub.add_parser(
        "export",
        help="a model folder (a stage's or an import) as a folder transformers and vLLM load",
    )
    mexport.add_argument("dir", type=Path)
    mexport.add_argument("--out", type=Path, required=True)
    mexport.add_argument(
        "--data",
        type=Path,
        default=None,
        help="the prepared data (its tokenizer); default data.out_dir",
    )
    mexport.add_argument(
        "--arch",
        default="",
        help="prefer this architecture (qwen3_moe, qwen2_moe, mixtral, olmoe, ernie4_5_moe)"
        " when it represents the model exactly",
    )
    _add_params(mexport)

    ask = sub.add_parser("ask", help="the SQL a model writes for a question, and its rows")
    ask.add_argument("dir", type=Path, help="a model folder (e.g. models/finetune_domain)")
    ask.add_argument("question")
    ask.add_argument("--db", type=Path, required=True, help="the sqlite database to ask")
    ask.add_argument("--data", type=Path, default=None, help="the prepared data (its tokenizer)")
    ask.add_argument("--rows", type=int, default=20, help="rows to print (default 20)")
    _add_params(ask)
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
            return _checkpoint(args)
        if args.command == "lineage":
            return _lineage(args)
        if args.command == "stack":
            return _stack(args)
        if args.command == "pools":
            return _pools(args, load_config(args.params, args.overrides))
        if args.command == "recovery":
            return _recovery(load_config(args.params, args.overrides))
        if args.command == "deployments":
            return _deployments(load_config(args.params, args.overrides))
        if args.command == "alerts":
            return _alerts(args)
        if args.command in ("model", "ask"):
            return _model(args, load_config(args.params, args.overrides))
        # Validate the params and what the stages need before importing Prefect or touching
        # anything: bad input is one message and exit 2, never a flow run's traceback.
        cfg = load_config(args.params, args.overrides)
        preflight(cfg, [args.name] if args.command == "stage" else (args.stages or STAGES))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG

    if getattr(args, "force", False):
        os.environ["MOE_FORCE"] = "1"
    try:
        if args.command == "stage":
            from flows.stages import STAGE_FLOWS

            STAGE_FLOWS[args.name](params_file=args.params, overrides=args.overrides)
            _where(args.name)
        elif args.command == "run":
            from flows.pipeline import pipeline

            pipeline(stages=args.stages, params_file=args.params, overrides=args.overrides)
            _where("evaluate" if not args.stages or "evaluate" in args.stages else args.stages[-1])
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


# What each stage reads that an earlier stage writes (local paths, as dvc.yaml lists them).
def preflight(cfg: Config, stages: list[str] | tuple[str, ...]) -> None:
    """Raise InputError for what the stages need and cannot get: a corpus with no readable
    text, or an upstream output that no stage of this run makes and that is missing or no
    longer matches the hash its stage's lineage record holds."""
    from flows.stages import STAGES_BY_NAME
    from moe.data.tokens import check_source

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


def _stack(args: argparse.Namespace) -> int:
    import json

    from flows import stack

    try:
        if args.stack_command == "up":
            stack.up(args.root, args.params, ui=not args.no_ui)
        elif args.stack_command == "status":
            print(json.dumps(stack.status(args.root), indent=1))
        elif args.stack_command == "down":
            if not stack.down(args.root):
                print("nothing of the stack was running")
        elif args.stack_command == "watch":
            stack.watch(args.root)
        else:
            result = stack.run(args.root, args.params, args.overrides, args.stages, args.handoff)
            work = args.root.resolve() / stack.STATE_DIR / "work"
            print(f"pipeline {result['state']}: {result['message'] or ''}".rstrip(": "))
            print(f"working folders of the pools (outputs, reports, checkpoints): {work}/<pool>")
            return 0 if result["completed"] else 1
    except stack.StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _pools(args: argparse.Namespace, cfg: Config) -> int:
    import json

    from flows.pools import create, job_template

    if args.pools_command == "template":
        if args.pool not in cfg.pools.definitions:
            raise InputError(
                f"pool {args.pool!r} is not in pools.definitions "
                f"({', '.join(sorted(cfg.pools.definitions))})"
            )
        print(json.dumps(job_template(cfg, args.pool, args.type, args.image_tag), indent=2))
        return 0
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for pool in create(client, cfg, args.type, args.image_tag):
            spec = cfg.pools.definitions[pool]
            print(
                f"pool {pool} ({args.type}): {spec.gpus} GPU(s) {spec.gpu_product or ''}, "
                f"{spec.cpu:g} CPU, {spec.memory_gib} GiB, on {client.api_url}"
            )
    return 0


def _recovery(cfg: Config) -> int:
    """`recovery install`: the two automations of flows/recovery.py on this server."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from flows.recovery import install

    with get_client(sync_client=True) as client:
        try:
            names = install(client, cfg.recovery)
        except ObjectNotFound:
            print(
                f"error: no deployment recover/recover on {client.api_url}: deploy prefect.yaml "
                "first (prefect deploy --all)",
                file=sys.stderr,
            )
            return 1
        where = client.api_url
    if not names:
        print(f"recovery.enabled is false: the automations were removed from {where}")
    for name in names:
        print(f"automation {name!r} on {where}")
    r = cfg.recovery
    print(
        f"workers must send flow-run heartbeats: PREFECT_FLOWS_HEARTBEAT_FREQUENCY={r.heartbeat_s} "
        f"in each worker's environment (a run is crashed after {r.crashed_after_s} s without one)"
    )
    return 0


def _deployments(cfg: Config) -> int:
    """`deployments configure`: the run forms' defaults on this server."""
    from prefect.client.orchestration import get_client

    from flows.deployments import set_form_defaults

    with get_client(sync_client=True) as client:
        changed = set_form_defaults(client, cfg)
        where = client.api_url
    if not changed:
        print(f"error: no deployment of prefect.yaml on {where}: run `prefect deploy --all` first")
        return 1
    print(f"run form defaults set on {where}: {', '.join(changed)}")
    return 0


def _alerts(args: argparse.Namespace) -> int:
    """`alerts install`: the automation of flows/deployments.py, to an existing block."""
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client

    from flows.deployments import install_alert
    from tasks.events import BUDGET_ALERT, EVENTS

    events = tuple(args.events or [BUDGET_ALERT])
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        print(
            f"error: unknown event(s) {unknown}; the events are {', '.join(EVENTS)}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    if "/" not in args.block:
        print(
            f"error: --block {args.block!r} must be TYPE/NAME, e.g. slack-webhook/moe-alerts",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        block = Block.load(args.block)
    except ValueError as e:
        print(f"error: no notification block {args.block}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    with get_client(sync_client=True) as client:
        name = install_alert(client, block._block_document_id, events)
        where = client.api_url
    print(f"automation {name!r} on {where}: {', '.join(events)} -> {args.block}")
    return 0


def _where(stage: str) -> None:
    from flows.stages import STAGES_BY_NAME

    print(f"{stage} done: {STAGES_BY_NAME[stage].done}")


def _lineage(args: argparse.Namespace) -> int:
    """Follow lineage records (each stage writes one beside its outputs) from an output back
    to the corpus: which stage made it, from which inputs, under which params and code, and
    whether each file still has the hash the record holds."""
    import json

    from tasks.lineage import content_hash

    root = args.root
    records = []
    for pattern in ("data/*/lineage.json", "models/*/lineage.json", "reports/**/lineage.json"):
        for f in sorted(root.glob(pattern)):
            try:
                records.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                print(f"warning: {f} is unreadable ({e}); skipped", file=sys.stderr)
    producers: dict[str, dict] = {}
    for r in records:
        for out in r.get("outputs", {}).values():
            producers[str(Path(out["path"]))] = r

    def find(path: str) -> tuple[str, dict] | None:
        if path in producers:
            return path, producers[path]
        inside = [p for p in producers if p.startswith(path.rstrip("/") + "/")]
        return (inside[0], producers[inside[0]]) if inside else None

    target = str(args.output)
    start = find(target)
    if start is None:
        known = ", ".join(sorted(producers)) or "none (run the pipeline first)"
        print(
            f"error: no stage's lineage record lists {target} as an output; known outputs: {known}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    chain: list[dict] = []

    def visit(path: str, rec: dict, depth: int, seen: set[str]) -> None:
        if path in seen:
            chain.append({"output": path, "depth": depth, "seen": True})
            return
        seen.add(path)
        recorded = next(
            o["sha256"] for o in rec["outputs"].values() if str(Path(o["path"])) == path
        )
        local = root / path
        now = content_hash(local) if local.exists() else None
        step = {
            "depth": depth,
            "stage": rec.get("stage"),
            "output": path,
            "sha256": recorded,
            "status": "ok" if now == recorded else ("missing" if now is None else "changed since"),
            "inputs": {k: v["path"] for k, v in rec.get("inputs", {}).items()},
            "code": rec.get("code", {}).get("commit"),
            "flow_run_id": rec.get("flow_run_id"),
            "wandb_run_id": rec.get("wandb_run_id"),
            "pool": rec.get("pool"),
            "started": rec.get("started"),
            "wall_s": rec.get("wall_s"),
            "cost": rec.get("cost"),
        }
        if rec.get("stage") == "prepare":
            meta = root / path / "meta.json"
            if meta.is_file():
                m = json.loads(meta.read_text())
                step["corpus"] = {
                    "source": m.get("source"),
                    "bytes": m.get("source_bytes"),
                    "sha256": m.get("source_sha256"),
                    "tokenizer_sha256": m.get("tokenizer_sha256"),
                }
        chain.append(step)
        for inp in rec.get("inputs", {}).values():
            nxt = find(str(Path(inp["path"])))
            if nxt is not None:
                visit(nxt[0], nxt[1], depth + 1, seen)

    visit(start[0], start[1], 0, set())
    if args.json:
        print(json.dumps(chain, indent=1))
        return 0
    for st in chain:
        pad = "  " * st["depth"]
        if st.get("seen"):
            print(f"{pad}{st['output']}  (above)")
            continue
        print(
            f"{pad}{st['output']}  <- stage {st['stage']}  [{st['status']}]  sha256 {st['sha256'][:12]}"
        )
        print(
            f"{pad}   code {str(st['code'])[:12]}  flow run {st['flow_run_id']}  pool {st['pool']}  "
            f"{st['wall_s'] or 0:.1f}s  cost {st['cost']}"
        )
        if st["inputs"]:
            print(f"{pad}   inputs: {', '.join(st['inputs'].values())}")
        if "corpus" in st:
            c = st["corpus"]
            print(
                f"{pad}   corpus: {c['source']} ({c['bytes']} bytes, sha256 {str(c['sha256'])[:12]})"
            )
    return 0


def _model(args: argparse.Namespace, cfg: Config) -> int:
    """model import / model export / ask: library calls (moe/hf/convert.py, tasks/publish.py)."""
    import time

    data_dir = args.data or Path(cfg.data.out_dir) if hasattr(args, "data") else None
    if args.command == "ask":
        from tasks.publish import ask

        got = ask(
            args.dir,
            args.question,
            args.db,
            data_dir,
            cfg.evaluate.max_new_tokens,
            cfg.data.sql_time_limit_s,
            cfg.data.sql_row_limit,
            cfg.data.sql_schema_values,
        )
        print(got["sql"])
        outcome = got["outcome"]
        if not outcome.ok:
            print(f"-- {outcome.status}: {outcome.message}")
            return 1
        for row in outcome.rows[: args.rows]:
            print(" | ".join(str(v) for v in row))
        more = len(outcome.rows) - args.rows
        print(f"-- {len(outcome.rows)} row(s)" + (f", {more} not shown" if more > 0 else ""))
        return 0
    t0 = time.perf_counter()
    if args.model_command == "import":
        from moe.hf.convert import import_model

        source = import_model(args.dir, args.out, cfg.moe, cfg.model.seq_len)
        how = " (dense, upcycled)" if source["upcycled"] else ""
        print(
            f"{source['model_type']}{how}: {args.dir} -> {args.out} in"
            f" {time.perf_counter() - t0:.1f}s; start from it with --set model.init={args.out}"
        )
        return 0
    from tasks.publish import export_model_dir

    plan = export_model_dir(args.dir, args.out, data_dir, Path("reports"), args.arch)
    print(f"{plan.architecture}: {args.dir} -> {args.out} in {time.perf_counter() - t0:.1f}s")
    for note in plan.notes:
        print(f"  {note}")
    return 0


def _store_root(root: Path) -> Path | None:
    """DIR itself, or DIR/checkpoints (a stage's model folder), whichever holds checkpoints."""
    for candidate in (root, root / "checkpoints"):
        if candidate.is_dir() and any(candidate.glob("step_*")):
            return candidate
    return None


def _checkpoint(args: argparse.Namespace) -> int:
    from moe.checkpoint.store import CheckpointStore, weights_digest

    root = _store_root(args.dir)
    if root is None:
        print(
            f"error: no checkpoints under {args.dir} (nor under {args.dir / 'checkpoints'})",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    store = CheckpointStore(root)
    cmd = args.checkpoint_command
    if cmd not in ("ls", "verify"):
        # Files an offload moved, or another machine of a multi-node run wrote, are in the
        # object store the params name: fetched (and verified) on first use.
        import functools

        from tasks.storage import open_store

        params, overrides = getattr(args, "params", None), getattr(args, "overrides", [])
        objects = functools.cache(lambda: open_store(load_config(params, overrides).storage))
        store.fetch = lambda key, dest: objects().get(key, dest)  # opened once, if at all
    if cmd in ("ls", "verify"):
        rows = store.info()
        for r in rows:
            tiers = " ".join(f"{t}={b / 1e6:.2f}MB" for t, b in sorted(r.tiers.items()))
            cold = sum(len(v.get("cold", [])) for v in r.experts.values())
            hot = sum(len(v.get("hot", [])) for v in r.experts.values())
            extra = f" deltas={r.deltas} bases={r.bases}" if r.deltas else ""
            status = "valid" if r.problem is None else f"INVALID: {r.problem}"
            lossy = " LOSSY" if r.lossy else ""
            sharded = f"  sharded: {r.ranks} ranks" if r.ranks else ""
            remote = f"  {len(r.remote)} files remote" if r.remote else ""
            print(
                f"{r.path.name}  step {r.step:>8}  {r.bytes / 1e6:8.2f} MB  {tiers}  "
                f"experts hot={hot} cold={cold}{extra}{lossy}{sharded}{remote}  {status}"
            )
        bad = [r for r in rows if r.problem is not None]
        if cmd == "verify":
            print(f"{len(rows) - len(bad)} of {len(rows)} checkpoints verify")
            return 1 if bad else 0
        return 0
    if cmd == "digest":
        path = store.latest_valid()
        if path is None:
            print(f"error: no valid checkpoint under {root}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"{weights_digest(store.load(path).model)}  {path}")
        return 0
    # restore / export
    step = getattr(args, "step", None)
    if step is None:
        path = store.latest_valid()
        if path is None:
            print(f"error: no valid checkpoint under {root}", file=sys.stderr)
            return EXIT_CONFIG
    else:
        path = store.step_dir(step)
        why = store.verify(path) if path.is_dir() else "there is no such checkpoint"
        if why is not None:
            steps = ", ".join(str(r.step) for r in store.info() if r.problem is None)
            print(
                f"error: step {step} under {root} cannot be restored: {why} "
                f"(valid steps: {steps or 'none'})",
                file=sys.stderr,
            )
            return EXIT_CONFIG
    from safetensors.torch import save_file

    ck = store.load(path)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    save_file(
        ck.model,
        str(tmp),
        metadata={"step": str(ck.step), "source": str(path), "lossy": str(bool(ck.lossy))},
    )
    tmp.replace(args.out)  # an interrupted export never leaves a half file under --out
    print(f"step {ck.step}: {len(ck.model)} tensors -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

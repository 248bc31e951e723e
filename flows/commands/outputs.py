"""`moe-pipeline lineage|checkpoint|model|ask`: what the stages made, in and out: an
output's lineage, checkpoints, Hugging Face models, and a model's answer to a question."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flows.commands import EXIT_CONFIG
from tasks.config import load_config


def lineage(args: argparse.Namespace) -> int:
    """`lineage`: the chain of tasks/lineage.py `lineage_chain`, as text or JSON."""
    import json

    from tasks.lineage import lineage_chain

    chain = lineage_chain(
        args.root, args.output, warn=lambda m: print(f"warning: {m}", file=sys.stderr)
    )
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


# --------------------------------------------------------------------------- checkpoints


def _store_root(root: Path) -> Path | None:
    """DIR itself, or DIR/checkpoints (a stage's model folder), whichever holds checkpoints."""
    for candidate in (root, root / "checkpoints"):
        if candidate.is_dir() and any(candidate.glob("step_*")):
            return candidate
    return None


def _open_checkpoints(args: argparse.Namespace, fetch: bool) -> tuple[Path, Any] | None:
    """The folder of args.dir that holds checkpoints and its CheckpointStore, or None (said
    on stderr). `fetch`: files an offload
    moved, or another machine of a multi-node run wrote, are in the object store the params
    name: fetched (and verified) on first use."""
    from moe.checkpoint.store import CheckpointStore

    root = _store_root(args.dir)
    if root is None:
        print(
            f"error: no checkpoints under {args.dir} (nor under {args.dir / 'checkpoints'})",
            file=sys.stderr,
        )
        return None
    store = CheckpointStore(root)
    if fetch:
        import functools

        from tasks.storage import open_store

        params, overrides = getattr(args, "params", None), getattr(args, "overrides", [])
        objects = functools.cache(lambda: open_store(load_config(params, overrides).storage))
        store.fetch = lambda key, dest: objects().get(key, dest)  # opened once, if at all
    return root, store


def checkpoint_ls(args: argparse.Namespace) -> int:
    """`checkpoint ls` and `checkpoint verify` (exit 1 if one fails)."""
    opened = _open_checkpoints(args, fetch=False)
    if opened is None:
        return EXIT_CONFIG
    store = opened[1]
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
    if args.checkpoint_command == "verify":
        print(f"{len(rows) - len(bad)} of {len(rows)} checkpoints verify")
        return 1 if bad else 0
    return 0


def checkpoint_digest(args: argparse.Namespace) -> int:
    """`checkpoint digest`: sha256 of the newest valid checkpoint's model weights."""
    from moe.checkpoint.tensors import weights_digest

    opened = _open_checkpoints(args, fetch=True)
    if opened is None:
        return EXIT_CONFIG
    root, store = opened
    path = store.latest_valid()
    if path is None:
        print(f"error: no valid checkpoint under {root}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{weights_digest(store.load(path).model)}  {path}")
    return 0


def checkpoint_restore(args: argparse.Namespace) -> int:
    """`checkpoint restore` (--step, default the newest valid) and `checkpoint export` (the
    newest valid): its model weights as one safetensors file."""
    opened = _open_checkpoints(args, fetch=True)
    if opened is None:
        return EXIT_CONFIG
    root, store = opened
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


# --------------------------------------------------------------------------- models


def model_import(args: argparse.Namespace) -> int:
    """`model import`: moe/hf/importer.py `import_model`."""
    import time

    cfg = load_config(args.params, args.overrides)
    t0 = time.perf_counter()
    from moe.hf.importer import import_model

    source = import_model(args.dir, args.out, cfg.moe, cfg.model.seq_len)
    how = ""
    if source["upcycled"]:
        how = " (dense, kept dense)" if cfg.moe.num_experts == 1 else " (dense, upcycled)"
    print(
        f"{source['model_type']}{how}: {args.dir} -> {args.out} in"
        f" {time.perf_counter() - t0:.1f}s; start from it with --set model.init={args.out}"
    )
    return 0


def model_export(args: argparse.Namespace) -> int:
    """`model export`: tasks/publish.py `export_model_dir`."""
    import time

    cfg = load_config(args.params, args.overrides)
    data_dir = args.data or Path(cfg.data.out_dir)
    t0 = time.perf_counter()
    from tasks.publish import export_model_dir

    plan = export_model_dir(args.dir, args.out, data_dir, Path("reports"), args.arch)
    print(f"{plan.architecture}: {args.dir} -> {args.out} in {time.perf_counter() - t0:.1f}s")
    for note in plan.notes:
        print(f"  {note}")
    return 0


def _prompt_settings(data: Any, data_dir: Path) -> dict[str, Any]:
    """How the prompt is built (schema values, pruning, question values) as `prepare` built
    the model's training prompts: from the prepared data's params.yaml when it has one (a
    setting changed since would otherwise ask the model in a form it never saw), else from
    the params given."""
    import yaml

    keys = ("sql_schema_values", "sql_schema_pruning", "sql_question_values")
    out = {k: getattr(data, k) for k in keys}
    path = data_dir / "params.yaml"
    if path.is_file():
        prepared = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
        out |= {k: prepared[k] for k in keys if k in prepared}
    return out


def answer(args: argparse.Namespace) -> int:
    """`ask`: tasks/publish.py `ask` (--db: a sqlite file, or a server's URL whose password
    data.sql_domain_password names); the SQL, then its rows (exit 1 if it fails)."""
    from tasks.publish import ask

    cfg = load_config(args.params, args.overrides)
    data_dir = args.data or Path(cfg.data.out_dir)
    prompt = _prompt_settings(cfg.data, data_dir)
    got = ask(
        args.dir,
        args.question,
        args.db,
        data_dir,
        cfg.evaluate.max_new_tokens,
        cfg.data.sql_time_limit_s,
        cfg.data.sql_row_limit,
        prompt["sql_schema_values"],
        prompt["sql_schema_pruning"],
        cfg.data.sql_domain_password,  # a server URL's password: where it comes from
        args.candidates or cfg.evaluate.candidates,
        cfg.evaluate.temperature,
        cfg.evaluate.constrain_identifiers,
        cfg.evaluate.vote,
        prompt["sql_question_values"],
        cfg.evaluate.device,
        cfg.evaluate.dtype,
    )
    if got["pruned"]:
        print(f"-- {got['pruned']}")
    if "agreed" in got:
        print(
            f"-- {got['agreed']} of {got['candidates']} candidates agreed"
            f" ({got['ran']} ran on the database)"
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

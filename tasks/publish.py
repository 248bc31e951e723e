"""A stage's model as a Hugging Face folder with its model card, and asking it a question.

`export_model_dir` is what `moe-pipeline model export` runs: the model folder a training stage
wrote (or an import) becomes what `AutoModelForCausalLM.from_pretrained` and vLLM load
(moe/hf/exporter.py), with the tokenizer the model was trained with and a README.md that says where it
came from: the lineage's input and code hashes, the evaluation table and the bill, when the
pipeline's reports are there.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from moe.adapters.peft import read_adapter_dir, write_peft_folder
from moe.data.tokenizer import Specials, load_tokenizer, specials
from moe.errors import InputError
from moe.hashing import sha256_file
from moe.hf.exporter import ExportPlan, export_hf, export_plan
from moe.hf.families.registry import FAMILIES
from moe.hf.model_dir import load_model_dir, read_model_spec
from moe.hf.tokenizer_files import copy_tokenizer, native_tokenizer_config
from moe.model.transformer import MoETransformer


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def find_tokenizer(model_dir: Path, data_dir: Path) -> Path:
    """The tokenizer.json a model was trained with: in its folder (an import), else the
    prepared data's (a stage's model)."""
    for folder in (model_dir, data_dir):
        if (folder / "tokenizer.json").is_file():
            return folder / "tokenizer.json"
    raise InputError(
        f"no tokenizer.json in {model_dir} nor in {data_dir}: name the prepared data with"
        " --data (the folder the prepare stage wrote)"
    )


def _evaluation_lines(summary: dict, metrics: dict, stage_name: str) -> list[str]:
    """The card's evaluation: every stage's figures, and this model's per kind of question."""
    lines = [
        "",
        "## Evaluation",
        "| stage | perplexity | execution accuracy (domain) | generic |",
        "|---|---|---|---|",
    ]
    for stage, row in summary.items():
        if isinstance(row, dict) and "ppl" in row:
            lines.append(
                f"| {stage} | {row['ppl']} | {row['exec_acc']} |"
                f" {row.get('generic_exec_acc', '')} |"
            )
    kinds = ((metrics.get(stage_name) or {}).get("sql") or {}).get("by_template") or {}
    if kinds:
        lines += [
            "",
            "Execution accuracy per kind of question (domain test set): "
            + ", ".join(
                f"{k} {v['execution_accuracy']:.2f} ({v['examples']})"
                for k, v in sorted(kinds.items())
                if isinstance(v, dict) and "execution_accuracy" in v
            ),
        ]
    return lines


def model_card(model_dir: Path, plan: ExportPlan, model: MoETransformer, reports: Path) -> str:
    spec = _read(model_dir / "model.json")
    lineage = _read(model_dir / "lineage.json")
    summary = _read(reports / "summary.json")
    metrics = _read(reports / "metrics.json")
    cost = _read(reports / "cost.json")
    c, m = model.cfg, model.mcfg
    lines = [
        "---",
        "library_name: transformers",
        "tags: [moe, text-to-sql, moe-pipeline]",
        "---",
        f"# {model_dir.name} ({plan.architecture})",
        "",
        f"A Mixture-of-Experts model trained by moe-pipeline: {c.n_layer} blocks, d_model"
        f" {c.d_model}, {m.num_experts} experts per MoE layer, top-{m.top_k};"
        f" {model.num_params() / 1e6:.2f}M parameters, {model.num_params(True) / 1e6:.2f}M"
        " active per token.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("PATH")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
        *[f"- {n}" for n in plan.notes],
    ]
    source = spec.get("source")
    if source:
        lines += [
            "",
            "## Started from",
            f"{source.get('model_type')} at `{source.get('path')}`"
            + (" (dense, upcycled to MoE)" if source.get("upcycled") else ""),
        ]
        for name, digest in sorted((source.get("files") or {}).items()):
            lines.append(f"- `{name}` sha256 `{digest}`")
    if lineage:
        code = lineage.get("code") or {}
        commit = str(code.get("commit", "unknown")) + (" (dirty)" if code.get("dirty") else "")
        lines += [
            "",
            "## Lineage",
            f"Stage `{lineage.get('stage')}`, code at commit `{commit}`.",
        ]
        for key, entry in sorted((lineage.get("inputs") or {}).items()):
            lines.append(f"- input `{key}`: `{entry.get('path')}` sha256 `{entry.get('sha256')}`")
    if summary or metrics:
        lines += _evaluation_lines(summary, metrics, model_dir.name)
    if cost:
        cur = cost.get("currency", "")
        lines += ["", "## The bill", "| stage | pool | cost |", "|---|---|---|"]
        for stage, row in (cost.get("by_stage") or {}).items():
            if isinstance(row, dict):
                lines.append(f"| {stage} | {row.get('pool', '')} | {row.get('cost', '')} {cur} |")
        lines.append(
            f"\nTotal {cost.get('total')} {cur}; saving against one pool"
            f" {cost.get('saving')} {cur}."
        )
    return "\n".join(lines) + "\n"


def export_model_dir(
    model_dir: Path, out: Path, data_dir: Path, reports: Path, prefer: str = ""
) -> ExportPlan:
    """`moe-pipeline model export`: refuses before writing anything when no architecture
    represents the model exactly; `out` is replaced only when the new folder is complete.
    A stage trained with LoRA or QLoRA (adapter.json beside its model) also gets a PEFT
    adapter folder, `<out>-adapter`, against its base exported to `<out>-base`, where PEFT
    can express what the stage trained (the plan's notes say what it cannot)."""
    model_dir = Path(model_dir)
    model = load_model_dir(model_dir)
    spec = _read(model_dir / "model.json")
    source = spec.get("source") or {}
    prefer = prefer or source.get("model_type", "")
    plan = export_plan(model, prefer)  # the refusal comes before any file is written
    card = model_card(model_dir, plan, model, reports)
    plan = _export(model, model_dir, out, data_dir, card, prefer, source)
    if (model_dir / "adapter.json").is_file():
        plan.notes.extend(_export_adapter(model_dir, Path(out), data_dir, plan, source))
    return plan


def _export(
    model: MoETransformer,
    model_dir: Path,
    out: Path,
    data_dir: Path,
    card: str,
    prefer: str,
    source: dict[str, Any],
) -> ExportPlan:
    """export_hf with the tokenizer the model was trained with."""
    tok_path = find_tokenizer(model_dir, data_dir)
    tok = load_tokenizer(tok_path)
    sp = specials(tok, tok_path)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp)
        (tok_dir / "tokenizer.json").write_bytes(tok_path.read_bytes())
        beside = tok_path.parent
        if (beside / "tokenizer_config.json").is_file():
            copy_tokenizer(beside, tok_dir)
        else:  # our own tokenizer: say which tokens are special, for AutoTokenizer
            names = {sp.eos: tok.id_to_token(sp.eos), sp.pad: tok.id_to_token(sp.pad)}
            config = native_tokenizer_config(names[sp.eos], names[sp.pad], model.cfg.seq_len)
            (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        ids = {"eos": sp.eos, "pad": sp.pad, "bos": sp.bos}
        return export_hf(
            model,
            out,
            tok_dir,
            ids,
            card,
            prefer=prefer,
            max_positions=int(source.get("max_position_embeddings") or 0),
        )


def _export_adapter(
    model_dir: Path, out: Path, data_dir: Path, plan: ExportPlan, source: dict[str, Any]
) -> list[str]:
    """The PEFT folder of a LoRA stage, or why there is none (the merged model is in `out`)."""
    spec, tensors, why = read_adapter_dir(model_dir)
    base_dir = Path(spec.get("base") or "")
    if why:
        return ["no PEFT adapter folder: " + "; ".join(why) + f"; the merged model is {out}"]
    base = load_model_dir(base_dir)
    base_out, adapter_out = out.with_name(out.name + "-base"), out.with_name(out.name + "-adapter")
    card = f"# Base of the adapter in {adapter_out.name}\n\nExported from {base_dir}.\n"
    _export(base, base_dir, base_out, data_dir, card, plan.model_type, source)
    write_peft_folder(base, tensors, spec, FAMILIES[plan.model_type], base_out, adapter_out)
    return [f"PEFT adapter: {adapter_out} (base: {base_out}); merged: {out}"]


def ask(
    model_dir: Path,
    question: str,
    db: Path | str,
    data_dir: Path,
    max_new_tokens: int = 128,
    time_limit_s: float = 2.0,
    row_limit: int = 10_000,
    schema_values: int = 0,
    prune_schema: bool = True,
    password: str = "",
    candidates: int = 1,
    temperature: float = 0.8,
    constrain: bool = False,
    vote: str = "grounded",
    question_values: int = 0,
    device: str = "auto",
    dtype: str = "auto",
) -> dict[str, Any]:
    """The SQL the model writes for `question` over the database `db` (a sqlite file, or a
    server's URL with its password from `password`: data.sql_domain_password; `ask_prompt`
    says what the model reads), the rows that SQL returns on a read-only, time- and
    row-limited connection (moe/sql/databases.py `open_database`), and what pruning left
    out ("" when nothing). With `candidates` > 1, execution-guided self-consistency
    (moe/sql/consistency.py): the answer most of the greedy and the sampled queries agree
    on (by `vote`: moe/sql/consistency.py `VOTES`), and how many agreed. With
    `constrain`, identifiers are held to the database's tables and columns while decoding
    (moe/sql/constrain.py). The model runs where evaluation runs it (`device`, `dtype`:
    evaluate.device and evaluate.dtype; auto is bf16 weights on a GPU, fp32 on a CPU)."""
    from moe.recipes.evaluate import load_for_evaluation
    from moe.sql.config import EvaluateConfig
    from moe.sql.consistency import choose
    from moe.sql.constrain import IdentifierConstraint, Names, Pieces
    from moe.sql.databases import open_database
    from moe.sql.evaluate import Candidates, stop_ids
    from moe.sql.grounding import for_database
    from moe.sql.spelling import in_schema_spelling
    from tasks.databases import remember_password

    remember_password(password)
    model = load_for_evaluation(Path(model_dir), EvaluateConfig(device=device, dtype=dtype)).eval()
    tok_path = find_tokenizer(Path(model_dir), data_dir)
    tok = load_tokenizer(tok_path)
    sp = specials(tok, tok_path)
    ro = open_database(db, time_limit_s, row_limit, password)
    try:
        prompt, pruned = _ask_prompt(ro, question, model.cfg.seq_len, tok, sp,
                                     max_new_tokens, schema_values, prune_schema,
                                     question_values)  # fmt: skip
        room, stop = model.cfg.seq_len - len(prompt), stop_ids(tok, sp.eos)
        pieces = Pieces(tok) if constrain else None
        names = [Names.of(ro.schema())] if constrain else None
        if candidates > 1:
            cands = Candidates(model, tok, min(max_new_tokens, room), stop, candidates,
                               temperature, 0)([prompt], pieces, names)[0]  # fmt: skip
            test = for_database(ro) if vote == "grounded" else None
            held = (lambda sql: test(sql, question)) if test else None
            c = choose(ro, cands, getattr(ro, "dialect", "sqlite"), vote == "rows", held)
            got = {"sql": c.sql, "agreed": c.agreed, "ran": c.ran, "candidates": candidates}
        else:
            held = IdentifierConstraint(tok, pieces, names) if pieces and names else None
            out = model.generate_batch([prompt], min(max_new_tokens, room), stop, adjust=held)
            sql = tok.decode(out[0]).strip()
            got = {"sql": in_schema_spelling(sql, names[0]) if names else sql}
        return {**got, "outcome": ro.run(got["sql"]), "pruned": pruned}
    finally:
        ro.close()


def ask_prompt(
    model_dir: Path,
    question: str,
    db: Path | str,
    data_dir: Path,
    max_new_tokens: int = 128,
    schema_values: int = 0,
    prune_schema: bool = True,
    password: str = "",
    question_values: int = 0,
) -> list[int]:
    """The tokens `ask` gives the model for `question` over `db`."""
    from moe.sql.databases import open_database

    seq_len = int(read_model_spec(Path(model_dir))["model"]["seq_len"])
    tok_path = find_tokenizer(Path(model_dir), data_dir)
    tok = load_tokenizer(tok_path)
    with open_database(db, password=password) as ro:
        return _ask_prompt(ro, question, seq_len, tok, specials(tok, tok_path),
                           max_new_tokens, schema_values, prune_schema,
                           question_values)[0]  # fmt: skip


def _ask_prompt(
    ro: Any,
    question: str,
    seq_len: int,
    tok: Any,
    sp: Specials,
    max_new_tokens: int,
    schema_values: int,
    prune_schema: bool,
    question_values: int = 0,
) -> tuple[list[int], str]:
    """The prompt for `question` (after the model's bos, in its chat template, as
    finetuning and evaluation give it) with the schema read from the database `ro` as prepare
    reads it, pruned to what the question names when the whole schema leaves the answer no
    room (with schema pruning on, as prepare does), the values it names (up to
    `question_values`: data.sql_question_values), and what pruning left out."""
    from moe.sql.prompts import prompt_text
    from moe.sql.pruners import pruner_for
    from moe.sql.records import SqlPair
    from moe.sql.sandbox import SchemaStyle, serialize_schema
    from moe.sql.values import values_line

    full = ro.schema()
    style = SchemaStyle(values=schema_values)
    pruner = pruner_for(full, ro)
    line = values_line(pruner.index, question, question_values) if question_values else ""

    def encode(schema: str) -> list[int]:
        pair = SqlPair(question, "", ro.label, schema, values=line)
        return [*sp.prefix, *tok.encode(sp.chat(prompt_text(pair)), add_special_tokens=False).ids]

    # room for the answer as evaluation gives it
    room_needed = min(max_new_tokens, seq_len // 2)
    prompt, pruned = encode(serialize_schema(full, style)), ""
    if len(prompt) + room_needed > seq_len and prune_schema:
        cut = pruner.prune(question, style, lambda text: len(encode(text)) + room_needed <= seq_len)
        if cut is not None:
            if question_values:  # no value of a table the cut left out (as prepare does)
                kept = set(cut.kept_tables)
                line = values_line(pruner.index, question, question_values, kept)
            prompt, pruned = encode(cut.text), cut.note
    if seq_len - len(prompt) < 1:
        raise InputError(
            f"the question with the schema of {ro.label} is {len(prompt)} tokens"
            f"{', even pruned,' if prune_schema else ''} and the model reads"
            f" {seq_len}: ask about a smaller database"
            + ("" if prune_schema else " or turn data.sql_schema_pruning on")
        )
    return prompt, pruned


def publish_model(cfg: Any, folder: Path, name: str) -> dict[str, Any]:
    """Upload an exported folder where the data is published, then read it back and check
    every file's sha256 (what the lineage records is what the store holds).

    - backend hf with storage.hf_model_repo: the files at the root of that *model* repo (what
      `from_pretrained("owner/name", revision=TAG)` reads), tagged `NAME-VERSION`;
    - otherwise (local, s3, hf datasets): `models/NAME/VERSION/` with a sha256 beside each
      file and a manifest written last (tasks/storage.py `push_files`).

    VERSION is the first 16 hex digits of the folder's content hash: the same model always
    lands at the same address, a changed one never overwrites an old one."""
    from tasks.lineage import content_hash
    from tasks.storage import HfObjectStore, open_store, pull_files, push_files, put_text

    folder = Path(folder)
    files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
    digests = {rel: sha256_file(p) for rel, p in files.items()}
    version = content_hash(folder)[:16]
    s = cfg.storage
    with tempfile.TemporaryDirectory() as tmp:
        back = Path(tmp)
        if s.backend == "hf" and s.hf_model_repo:
            store = HfObjectStore(s, repo=s.hf_model_repo, repo_type="model", prefix="")
            for rel, path in files.items():
                store.put(path, rel)
            manifest = {"name": name, "version": version, "files": digests}
            put_text(store, "moe-pipeline-manifest.json", json.dumps(manifest, indent=1))
            tag = f"{name}-{version}"
            store.tag(tag)
            for rel in files:
                (back / rel).parent.mkdir(parents=True, exist_ok=True)
                store.get(rel, back / rel)
            got = {rel: sha256_file(back / rel) for rel in files}
            where = f"{store.uri}@{tag}"
        else:
            store = open_store(s)
            prefix = f"models/{name}/{version}"
            push_files(store, prefix, files, extra={"name": name, "version": version})
            pull_files(store, prefix, back, "the upload did not complete")  # checks sha256
            got = {rel: sha256_file(back / rel) for rel in files}
            where = f"{store.uri}/{prefix}"
    bad = sorted(rel for rel in files if got.get(rel) != digests[rel])
    if bad:
        raise ValueError(f"{where}: {bad[0]} read back does not match what was uploaded")
    return {"uri": where, "version": version, "files": digests}


def export_final(
    cfg: Any, model_dir: Path, out: Path, data_dir: Path, reports: Path
) -> dict[str, Any]:
    """What the evaluate stage does last: export the final model (`evaluate.export_model`)
    and publish it (`evaluate.publish_model`). A model that no architecture represents
    exactly is not exported: `out` then holds EXPORT_REFUSED.md saying why, and the stage
    goes on (the reason is in its metrics and lineage)."""
    import logging
    import shutil

    log = logging.getLogger(__name__)
    shutil.rmtree(out, ignore_errors=True)
    try:
        plan = export_model_dir(model_dir, out, data_dir, reports)
    except InputError as e:
        out.mkdir(parents=True, exist_ok=True)
        (out / "EXPORT_REFUSED.md").write_text(f"# {model_dir} was not exported\n\n{e}\n")
        log.warning("the final model was not exported: %s", e)
        return {"exported": False, "reason": str(e)}
    result: dict[str, Any] = {"exported": True, "architecture": plan.architecture}
    if cfg.evaluate.publish_model:
        result["published"] = publish_model(cfg, out, cfg.storage.model_name)
        log.info("published the exported model to %s", result["published"]["uri"])
    return result

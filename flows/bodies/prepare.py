"""The prepare stage: tokenize the corpus into memmap token files and generate the SQL pair
sets (CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

from flows.stage import Done, Stage, files
from moe.sql.domain import DomainDatabase
from tasks.config import Config
from tasks.data import build_sql_sets, build_tokenizer, commit_folder, tokenize_corpus
from tasks.databases import preflight
from tasks.lineage import StageRecord


def _corpus(cfg: Config) -> dict[str, Path]:
    """The corpus and the user's SQL files (databases, pairs, a Spider/BIRD folder) as
    content-hashed inputs, where they are local files or folders (the stdlib corpus is
    identified by the Python version, a hub dataset by its id, in the params hash): editing
    one in place re-runs prepare."""
    d, domain = cfg.data, DomainDatabase.of(cfg.data)
    named = {
        "corpus": d.source if d.source != "stdlib" else "",
        "sql_generic_source": d.sql_generic_source if d.sql_generic_source != "generated" else "",
        "sql_domain_database": str(domain.local_input() or ""),
        "sql_domain_pairs": d.sql_domain_pairs,
        "sql_domain_test": d.sql_domain_test,
        "tokenizer": cfg.tokenizer.path,  # model.init's own tokenizer, or one the user named
        # a server domain: its fingerprint (schema and row counts), rewritten by prepare and
        # evaluate (tasks/databases.py), so that a changed database re-runs prepare
        "domain_database": "domain_database.json" if domain.kind == "server" else "",
    }
    out = {}
    for key, value in named.items():
        path = Path(value).expanduser() if value else None
        if path is not None and path.exists():
            out[key] = path
    return out


def _prepare(cfg: Config, record: StageRecord) -> Done:
    """Tokenize the corpus into memmap token files and generate the SQL pair sets (CPU)."""
    out = Path(cfg.data.out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        preflight(cfg.data)  # a server domain reached (URL, password, login) before any compute
        tok = build_tokenizer(cfg, tmp)
        # the SQL pairs first: each is executed and fitted before the corpus is tokenized
        sql = build_sql_sets(cfg, tmp, tok)
        meta = tokenize_corpus(cfg, tmp, tok)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous prepared data stays as it was
        raise
    commit_folder(tmp, out)
    summary = {
        "documents": meta["documents"],
        "train_tokens": meta["splits"]["train"]["tokens"],
        "val_tokens": meta["splits"]["val"]["tokens"],
        "vocab_size": meta["vocab_size"],
        "skipped_undecodable": meta["skipped_undecodable"],
        "tokens_per_s": meta["tokens_per_s"],
        **{f"sql_{k}": v for k, v in sql["counts"].items()},
        "sql_skipped_records": sql["skipped_records"],
    }
    return Done(summary, {"prepared": out})


def _prepared_handoff(cfg: Config) -> list[Path]:
    prepared = Path(cfg.data.out_dir)
    if cfg.pools.stages["publish"] == cfg.pools.stages["prepare"]:
        # publish runs on the same pool's disk: only the records travel
        names = ["lineage.json", "params.yaml", "meta.json"]
        return [prepared / n for n in names if (prepared / n).is_file()]
    return files(prepared)  # publish runs elsewhere: it needs the whole prepared folder


PREPARE = Stage(
    "prepare",
    "data",
    "Tokenize the corpus into memmap token files and generate the SQL pair sets (CPU).",
    out=lambda cfg: Path(cfg.data.out_dir),
    inputs=_corpus,
    handoff=_prepared_handoff,
    body=_prepare,
    done="data/prepared/",
)

"""Prepare: corpus -> tokenizer -> memmap token files, and the SQL pair sets.

Everything is written into a temporary folder and moved into place only when complete, so a
failed or interrupted prepare leaves the previous prepared data untouched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moe.data.sources import CorpusStats, iter_documents
from moe.data.tokenizer import (
    batch_encoder,
    load_tokenizer,
    specials,
    tokenizer_hash,
    train_tokenizer,
)
from moe.data.tokens import write_token_store
from moe.errors import InputError
from moe.sql.fitting import Limits
from moe.sql.sets import build_sql_sets as build_sets
from tasks import retry_unless_input_error
from tasks.config import Config
from tasks.databases import FINGERPRINT_FILE, preflight, write_fingerprint

log = logging.getLogger(__name__)


def _train_cap(cfg: Config) -> int:
    """Bytes the tokenizer trains on: a sample is enough for BPE and keeps memory bounded."""
    caps = [c for c in (cfg.data.max_bytes, cfg.tokenizer.train_bytes) if c > 0]
    return min(caps) if caps else 0


def corpus_documents(cfg: Config, max_bytes: int, stats: CorpusStats) -> Iterator[str]:
    d = cfg.data
    return iter_documents(
        d.source, d.text_field, max_bytes, stats, d.on_bad_record, d.encoding, d.doc_max_bytes
    )


@task(
    name="train-tokenizer",
    cache_policy=NONE,
    retries=1,
    retry_condition_fn=retry_unless_input_error,
)
def build_tokenizer(cfg: Config, work: Path) -> Path:
    out = work / "tokenizer.json"
    if cfg.tokenizer.path:
        load_tokenizer(cfg.tokenizer.path)  # validates special tokens
        shutil.copyfile(cfg.tokenizer.path, out)
        # A model's own tokenizer names its special tokens here (moe/data/tokenizer.py `specials`).
        config = Path(cfg.tokenizer.path).with_name("tokenizer_config.json")
        if config.is_file():
            shutil.copyfile(config, work / "tokenizer_config.json")
            c = json.loads(config.read_text())
            if not cfg.tokenizer.chat_template and "chat_template" in c:
                del c["chat_template"]
                (work / "tokenizer_config.json").write_text(json.dumps(c, indent=2))
        else:
            (work / "tokenizer_config.json").unlink(missing_ok=True)
        # ... and its chat template, in which every stage asks it (moe/data/tokenizer.py)
        for name in ("chat_template.jinja", "chat_template.json"):
            src = Path(cfg.tokenizer.path).with_name(name)
            if cfg.tokenizer.chat_template and src.is_file():
                shutil.copyfile(src, work / name)
            else:
                (work / name).unlink(missing_ok=True)
        return out
    stats = CorpusStats()
    t0 = time.perf_counter()
    tok = train_tokenizer(
        corpus_documents(cfg, _train_cap(cfg), stats),
        cfg.tokenizer.vocab_size,
        cfg.tokenizer.min_frequency,
    )
    tok.save(str(out))
    log.info(
        "trained a %d-token BPE on %d documents (%.1f MB) in %.1fs",
        tok.get_vocab_size(),
        stats.documents,
        stats.bytes / 1e6,
        time.perf_counter() - t0,
    )
    return out


@task(
    name="tokenize-corpus",
    cache_policy=NONE,
    retries=1,
    retry_condition_fn=retry_unless_input_error,
)
def tokenize_corpus(cfg: Config, work: Path, tokenizer_path: Path) -> dict[str, Any]:
    tok = load_tokenizer(tokenizer_path)
    eot = specials(tok, tokenizer_path).eos
    stats = CorpusStats()
    t0 = time.perf_counter()
    docs = corpus_documents(cfg, cfg.data.max_bytes, stats)

    with Progress(
        TextColumn("tokenizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("documents"),
        TimeElapsedColumn(),
        disable=not os.isatty(2),
    ) as bar:
        job = bar.add_task("tokenize", total=None)
        splits = write_token_store(
            docs,
            batch_encoder(tok),
            eot,
            tok.get_vocab_size(),
            work,
            {"val": cfg.data.val_fraction, "replay": cfg.data.replay_fraction},
            cfg.data.seed,
            progress=lambda n: bar.advance(job, n),
        )
    seconds = time.perf_counter() - t0
    total_tokens = sum(s["tokens"] for s in splits.values())
    meta = {
        "dtype": "uint16" if tok.get_vocab_size() <= 1 << 16 else "uint32",
        "vocab_size": tok.get_vocab_size(),
        "eot_id": eot,
        "splits": splits,
        "documents": stats.documents,
        "source": cfg.data.source,
        "source_bytes": stats.bytes,
        "source_sha256": stats.sha256,
        "skipped_undecodable": stats.skipped_undecodable,
        "skipped_records": stats.skipped_records,
        "skipped_files": stats.skipped_files,
        "tokenizer_sha256": tokenizer_hash(tokenizer_path),
        "tokens_per_s": round(total_tokens / max(seconds, 1e-9)),
    }
    meta_path = work / "meta.json"  # build_sql_sets may have written its part already
    before = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta_path.write_text(json.dumps({**before, **meta}, indent=1))
    if stats.skipped_undecodable:
        log.warning(
            "skipped %d undecodable (non-UTF-8) files: %s",
            stats.skipped_undecodable,
            ", ".join(stats.skipped_files[:5]),
        )
    log.info(
        "tokenized %d documents into %d tokens (%d train / %d val) at %.0f tokens/s",
        stats.documents,
        total_tokens,
        splits["train"]["tokens"],
        splits["val"]["tokens"],
        meta["tokens_per_s"],
    )
    return meta


@task(
    name="build-sql-pairs",
    cache_policy=NONE,
    retries=1,
    retry_condition_fn=retry_unless_input_error,
)
def build_sql_sets(cfg: Config, work: Path, tokenizer_path: Path) -> dict[str, Any]:
    """The SQL pair sets (moe/sql/sets.py), every pair executed on its database and every example
    fitted to the model's lengths with the tokenizer it will be trained with. Returns what
    meta.json records under `sql`: counts per set and kind, sources, skipped records,
    schema notes and token lengths."""
    tok = load_tokenizer(tokenizer_path)
    sp = specials(tok, tokenizer_path)
    prefix = len(sp.prefix)  # a bos the model wants in front
    budget = cfg.model.seq_len - cfg.evaluate.max_new_tokens
    if budget < 1:
        raise InputError(
            f"evaluate.max_new_tokens={cfg.evaluate.max_new_tokens} leaves no room for a prompt"
            f" in model.seq_len={cfg.model.seq_len}: lower it"
        )
    limits = Limits(
        count=lambda texts: (
            [prefix + len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
            if texts
            else []
        ),
        prompt_max=budget,
        response_max=cfg.evaluate.max_new_tokens,
        wrap=sp.chat,
        total_max={
            "train": cfg.finetune_sql.max_len,
            "generic": cfg.finetune_sql.max_len,
            "train_domain": cfg.finetune_domain.max_len,
            "domain": cfg.finetune_domain.max_len,
        },
        keys={
            "train": "finetune_sql.max_len",
            "generic": "finetune_sql.max_len",
            "train_domain": "finetune_domain.max_len",
            "domain": "finetune_domain.max_len",
            "prompt": "model.seq_len - evaluate.max_new_tokens",
            "response": "evaluate.max_new_tokens",
        },
    )
    t0 = time.perf_counter()
    preflight(cfg.data)  # a server domain: reachable, and said when its login may write
    sets = build_sets(cfg.data, work / "sql", limits)
    summary = sets.summary()
    # the domain database as prepare read it: a dep of dvc.yaml's prepare stage
    write_fingerprint(summary["domain_database"])
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    for line in sets.skipped[:20]:
        log.warning("skipped (data.on_bad_record: skip): %s", line)
    if len(sets.skipped) > 20:
        log.warning("... and %d more skipped records (meta.json)", len(sets.skipped) - 20)
    for note in sets.notes:
        log.warning("schema shortened: %s", note)
    if "sha256" in summary["domain_database"]:
        log.info(
            "the domain database %s: fingerprint %s (%s), in %s",
            summary["domain_database"]["database"],
            summary["domain_database"]["sha256"][:16],
            ", ".join(f"{t} {n}" for t, n in summary["domain_database"]["tables"].items()),
            FINGERPRINT_FILE,
        )
    log.info(
        "SQL pairs that execute on their databases: %s (sources %s, %d skipped) in %.1fs",
        summary["counts"],
        summary["sources"],
        summary["skipped_records"],
        summary["seconds"],
    )
    meta_path = work / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["sql"] = summary
    meta_path.write_text(json.dumps(meta, indent=1))
    return summary


def commit_folder(tmp: Path, final: Path) -> None:
    """Replace `final` with the complete `tmp` folder (old copy removed only after)."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)

"""The text-to-SQL pair sets a prepare makes: `build_sql_sets` takes each source's records
(moe/sql/sources.py), fits each database's schema text to the model's lengths
(moe/sql/fitting.py) and writes the five sets with copies of their databases (a server
database stays where it is: its link, dbs/domain.url); `SqlSets` says what was made, skipped
and left out, and what the domain database was (its fingerprint). No test question is a
training one.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe.errors import InputError
from moe.sql.databases import Databases
from moe.sql.domain import DomainDatabase
from moe.sql.fitting import Limits, fit_schema
from moe.sql.generator import KINDS
from moe.sql.prompts import prompt_text, response_text
from moe.sql.pruners import pruner_for
from moe.sql.pruning import Pruned
from moe.sql.records import Record, SqlPair, settle
from moe.sql.sandbox import SchemaStyle, copy_database, serialize_schema
from moe.sql.sources import Split, domain_records, generated_generic, outside_generic
from moe.sql.values import values_line

SET_ROLE = {  # which length limit a set's examples must fit
    "generic": "train",
    "generic_test_seen": "generic",
    "generic_test_heldout": "generic",
    "domain_train": "train_domain",
    "domain_test": "domain",
}


@dataclass
class SqlSets:
    """What a prepare made: the five sets, what was skipped and why, the schema notes."""

    sets: dict[str, list[SqlPair]]
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # outside test pairs also in training
    sources: dict[str, str] = field(default_factory=dict)
    longest: dict[str, int] = field(default_factory=dict)  # tokens, per set
    schema_tokens: dict[str, int] = field(default_factory=dict)  # per database
    # per set: examples given a pruned schema, and of those how many kept their gold tables
    pruned: dict[str, dict[str, int]] = field(default_factory=dict)
    # the domain database at prepare: where, and its schema-and-row-count `fingerprint`
    domain: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "counts": {k: len(v) for k, v in self.sets.items()},
            "kinds": {
                k: {kind: sum(p.kind == kind for p in v) for kind in KINDS}
                for k, v in self.sets.items()
            },
            "sources": self.sources,
            # per set: pairs the generator wrote (an outside source's `sql_generic_generated`)
            "generated_pairs": {
                k: sum(p.origin == "generated" for p in v) for k, v in self.sets.items()
            },
            "skipped_records": len(self.skipped),
            "skipped": self.skipped[:50],
            "schema_notes": self.notes,
            "test_pairs_left_out": len(self.dropped),
            "test_pairs_left_out_why": self.dropped[:20],
            "longest_example_tokens": self.longest,
            "schema_tokens": self.schema_tokens,
            "schema_pruned": self.pruned,
            "domain_database": self.domain,
        }


def build_sql_sets(d: Any, out_dir: Path, limits: Limits) -> SqlSets:
    """Read, generate, check and split every pair set of `d` (a DataConfig), write them
    under out_dir (`generic.jsonl`, `generic_test_seen.jsonl`, `generic_test_heldout.jsonl`,
    `domain_train.jsonl`, `domain_test.jsonl` and `dbs/*.sqlite`) and say what was skipped.
    No test question is a training one. The generic and the domain sets draw from streams of
    their own, so a knob of one (`data.sql_generic_wordings`, `..._pairs`) leaves the other's
    database, pairs and test set as they were."""
    rng = random.Random(d.seed)
    dbs_dir = out_dir / "dbs"
    dbs_dir.mkdir(parents=True, exist_ok=True)
    dbs = Databases(d.sql_time_limit_s, d.sql_row_limit)
    bad: list[str] = []
    result_dropped: list[str] = []
    try:
        g, gsrc = _generic(d, dbs_dir, dbs, rng, bad, result_dropped)
        domain_rng = random.Random(f"{d.seed}/domain")
        dtrain, dtest, src = domain_records(d, dbs_dir, dbs, domain_rng, bad)
        settle(bad, d.on_bad_record, "the domain's pairs")
        _refuse_empty(g, gsrc, dtrain, dtest)
        raw = {
            "generic": g[0],
            "generic_test_seen": g[1],
            "generic_test_heldout": g[2],
            "domain_train": dtrain,
            "domain_test": dtest,
        }
        result = SqlSets({}, bad, sources={"generic": gsrc, **src}, dropped=result_dropped)
        result.domain = DomainDatabase.of(d).fingerprint(dbs_dir, dbs)
        names = _database_names(raw, dbs_dir)
        texts, too_long, pruned = _fit_schemas(raw, dbs, d, limits, names, result)
        _make_sets(raw, names, texts, too_long, pruned, limits, result)
    finally:
        dbs.close()
    _write(result, out_dir)
    return result


def _generic(
    d: Any,
    dbs_dir: Path,
    dbs: Databases,
    rng: random.Random,
    bad: list[str],
    dropped: list[str],
) -> tuple[Split, str]:
    """The generic sets of `data.sql_generic_source`, and the source's name; bad records
    are refused or counted (data.on_bad_record)."""
    if d.sql_generic_source == "generated":
        g = generated_generic(
            dbs_dir, dbs, rng, d.sql_generic_pairs, d.sql_generic_test_pairs,
            d.sql_generic_wordings,
        )  # fmt: skip
        gsrc = "generated"
    else:
        g = outside_generic(d, dbs, rng, bad, dropped)
        gsrc = d.sql_generic_source
    settle(bad, d.on_bad_record, f"data.sql_generic_source ({gsrc})")
    return g, gsrc


def _refuse_empty(g: Split, gsrc: str, dtrain: list[Record], dtest: list[Record]) -> None:
    if not dtest:
        raise InputError("the domain test set is empty: give data.sql_domain_test pairs")
    if not g[0]:
        raise InputError(f"data.sql_generic_source ({gsrc}): no training pair runs")
    if not dtrain:
        raise InputError(
            "the domain has no training pair: give data.sql_domain_pairs, or a database"
            " with rows the generator can ask about (data.sql_domain_database)"
        )


def _database_names(raw: dict[str, list[Record]], dbs_dir: Path) -> dict[Path, str]:
    """The database files a pair names in the prepared folder (copies of outside ones)."""
    names: dict[Path, str] = {}
    for recs in raw.values():
        for r in recs:
            if r.db not in names:
                if r.db.parent == dbs_dir:
                    names[r.db] = r.db.name
                else:
                    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", r.db.stem)
                    name, k = f"generic_{stem}.sqlite", 1
                    while name in names.values():
                        k += 1
                        name = f"generic_{stem}_{k}.sqlite"
                    copy_database(r.db, dbs_dir / name)
                    names[r.db] = name
    return names


def _fit_schemas(
    raw: dict[str, list[Record]],
    dbs: Databases,
    d: Any,
    limits: Limits,
    names: dict[Path, str],
    result: SqlSets,
) -> tuple[dict[Path, str], set[int], dict[int, Pruned]]:
    """Each database's schema text, fitted to every example on it, the ids of the generated
    records that do not fit the model, and the examples given a pruned schema (when
    data.sql_schema_pruning is on); the notes and schema sizes go to `result`."""
    texts: dict[Path, str] = {}
    too_long: set[int] = set()  # generated records that do not fit the model
    pruned: dict[int, Pruned] = {}
    by_db: dict[Path, list[tuple[str, Record]]] = {}
    for set_name, recs in raw.items():
        for r in recs:
            by_db.setdefault(r.db, []).append((SET_ROLE[set_name], r))
    for db_path, members in by_db.items():
        db = dbs.get(db_path)
        schema = db.schema()
        pruner = pruner_for(schema, db)
        if d.sql_question_values:
            for _, r in members:
                r.values = values_line(pruner.index, r.question, d.sql_question_values)
        fitted = fit_schema(
            db_path,
            lambda style, s=schema: serialize_schema(s, style),
            members,
            SchemaStyle(d.sql_schema_values, True),
            limits,
            pruner if d.sql_schema_pruning else None,
        )
        texts[db_path] = fitted.text
        if d.sql_question_values:  # a pruned example names no value of a table it lost
            for _, r in members:
                if id(r) in fitted.pruned:
                    kept = set(fitted.pruned[id(r)].kept_tables)
                    r.values = values_line(pruner.index, r.question, d.sql_question_values, kept)
        too_long |= fitted.dropped
        pruned |= fitted.pruned
        result.schema_tokens[names[db_path]] = fitted.schema_tokens
        if fitted.note:
            result.notes.append(fitted.note.replace(db_path.name, names[db_path], 1))
    return texts, too_long, pruned


def _make_sets(
    raw: dict[str, list[Record]],
    names: dict[Path, str],
    texts: dict[Path, str],
    too_long: set[int],
    pruned: dict[int, Pruned],
    limits: Limits,
    result: SqlSets,
) -> None:
    """The pairs of each set in `result`, with their schema text, less those too long; a
    training or domain set left empty is refused."""
    for set_name, recs in raw.items():
        recs = [r for r in recs if id(r) not in too_long]
        if not recs and set_name in ("generic", "domain_train", "domain_test"):
            raise InputError(
                f"no {set_name} pair fits the model's lengths ({limits.keys['prompt']} ="
                f" {limits.prompt_max}, {limits.keys['response']} = {limits.response_max},"
                f" the finetune max_len {max(limits.total_max.values())}): raise"
                " model.seq_len and the finetune stages' max_len"
            )
        pairs = [_pair(r, names, texts, pruned.get(id(r))) for r in recs]
        cut = [(r, pruned[id(r)]) for r in recs if id(r) in pruned]
        if cut:
            result.pruned[set_name] = {
                "examples": len(cut),
                # a test question keeps its gold tables only if its words found them
                "gold_tables_kept": sum(p.gold_kept for _, p in cut),
            }
        result.sets[set_name] = pairs
        result.longest[set_name] = max(
            (
                n + 1
                for n in limits.count(
                    [limits.wrap(prompt_text(p)) + response_text(p) for p in pairs]
                )
            ),
            default=0,
        )


def _pair(r: Record, names: dict[Path, str], texts: dict[Path, str], cut: Pruned | None) -> SqlPair:
    schema, note = (texts[r.db], "") if cut is None else (cut.text, cut.note)
    return SqlPair(
        r.question,
        r.sql,
        names[r.db],
        schema,
        "",
        r.evidence,
        r.weight,
        r.where,
        pruned=note,
        values=r.values,
    )


def _write(result: SqlSets, out_dir: Path) -> None:
    for name, pairs in result.sets.items():
        if not pairs and name.startswith("generic_test"):
            continue  # e.g. Spider: its dev databases are all held out, none is 'seen'
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for pair in pairs:
                f.write(pair.to_json() + "\n")

"""Where each pair set's records come from, split so that no test question was trained on.

Finetuning runs in two stages: ~10,000 generic pairs (`data.sql_generic_source`), then ~500
pairs of the target domain (`data.sql_domain_database`). Either comes from:

- the embedded default: databases built from the themes (moe/sql/themes.py: a parent table
  and a child that references it, random rows), then questions generated from each
  database's own schema by moe/sql/generator.py, the same generator a user's database gets;
- generic corpora people have: a folder in Spider's layout (`tables.json`,
  `database/<db_id>/<db_id>.sqlite`, pair files such as `train_spider.json` and `dev.json`),
  BIRD's (the same, `*_databases/` folders, `SQL` and `evidence` fields), or a JSONL file of
  `{question, sql, db}` with `db` a sqlite path relative to the file (moe/sql/records.py
  reads them);
- the user's domain: their sqlite file or their database on a server (a SQLAlchemy URL:
  PostgreSQL, moe/sql/server.py; its pairs are generated and checked in its own dialect, on
  the server), their own `{question, sql}` pairs (JSONL), and pairs generated from that
  database's schema and rows when they have few or none.

Each source gives its training records and its test records: for the generic sets, test
pairs on databases trained on ('seen') and on databases never trained on ('held out');
test sets are stratified over the kinds of query.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from moe.errors import InputError
from moe.sql.databases import Databases, check_records
from moe.sql.domain import DomainDatabase
from moe.sql.generator import KINDS, QuestionGenerator, kind_of
from moe.sql.records import (
    Record,
    drop_trained_pairs,
    norm_question,
    norm_sql,
    read_corpus_folder,
    read_jsonl,
    settle,
)
from moe.sql.themed import build_database
from moe.sql.themes import GENERIC_THEMES, HELD_OUT_THEMES

Split = tuple[list[Record], list[Record], list[Record]]  # training, test seen, test held out

# --------------------------------------------------------------------------- databases, pairs


def generate_records(
    db_path: Path,
    dbs: Databases,
    rng: random.Random,
    count: int,
    seen: set[tuple[Path, str]],
    wordings: str = "varied",
) -> list[Record]:
    """Up to `count` new (question, SQL) pairs generated from the database's own schema and
    rows, in its engine's dialect, each executed before it is kept; `seen` holds what any set
    already has; `wordings` is the stage's (`data.sql_generic_wordings` or `sql_domain_wordings`)."""
    db = dbs.get(db_path)
    gen = QuestionGenerator(db.schema(), wordings)
    stream = gen.stream(rng)
    out: list[Record] = []
    for _ in range(count * 50):
        if len(out) >= count:
            break
        got = next(stream, None)
        if got is None:
            break
        q, sql = got
        if (db_path, norm_question(q)) in seen:
            continue  # asked already: nothing to rewrite or run
        sql = gen.in_dialect(sql)  # a server's dialect (sqlglot); sqlite's stays as it is
        keys = {(db_path, sql), (db_path, norm_question(q)), (db_path, norm_sql(sql))}
        if keys & seen or not db.run(sql).ok or tied_at_the_cut(db, sql):
            continue
        seen.update(keys)
        out.append(Record(q, sql, db_path, "generated"))
    return out


_CUT = re.compile(
    r"^SELECT (?P<select>.+?) FROM (?P<rest>.+) ORDER BY (?P<key>.+?) (?P<dir>ASC|DESC)"
    r"(?P<nulls> NULLS (?:FIRST|LAST))? LIMIT (?P<k>\d+)$",
    re.IGNORECASE | re.DOTALL,
)


def tied_at_the_cut(db: Any, sql: str) -> bool:
    """Whether a query's `ORDER BY key LIMIT k` leaves a tie to the engine: the k-th and the
    next row share the key (which of them the answer holds), or two of the first k do (their
    order, which an ordered comparison reads). sqlite keeps insertion order, PostgreSQL
    another: "which has the fewest" had three right answers and one gold. Such a pair is not
    kept."""
    m = _CUT.match(sql.strip())
    if not m:
        return False
    k = int(m["k"])
    probe = (
        f"SELECT {m['key']} FROM {m['rest']} ORDER BY {m['key']} {m['dir']}"
        f"{m['nulls'] or ''} LIMIT {k + 1}"
    )
    got = db.run(probe)
    keys = got.rows if got.ok else None
    # at the cut (which rows are in), or inside it (their order, which the comparison reads)
    return keys is not None and any(keys[i] == keys[i + 1] for i in range(min(k, len(keys) - 1)))


# --------------------------------------------------------------------------- splitting


def _stratified(records: list[Record], count: int, share: float = 1.0) -> list[Record]:
    """Up to `count` records taken round-robin over the kinds, so that a test set is not
    all of the kind with the most distinct questions; at most `share` of each kind."""
    by: dict[str, list[Record]] = {k: [r for r in records if kind_of(r.sql) == k] for k in KINDS}
    cap = {k: max(1, int(len(v) * share)) if v else 0 for k, v in by.items()}
    out: list[Record] = []
    taken = dict.fromkeys(KINDS, 0)
    while len(out) < count and any(by[k] and taken[k] < cap[k] for k in KINDS):
        for k in KINDS:
            if by[k] and taken[k] < cap[k] and len(out) < count:
                out.append(by[k].pop(0))
                taken[k] += 1
    return out


def _split_pool(pool: list[Record], n_test: int, n_train: int) -> tuple[list[Record], list[Record]]:
    """A stratified test set (every kind, at most half of each kind's pairs) and a training
    set sharing neither a question nor a SQL text with it."""
    test = _stratified(pool, n_test, share=0.5)
    held = {norm_question(r.question) for r in test} | {r.sql for r in test}
    train = [
        r
        for r in pool
        if r not in test and norm_question(r.question) not in held and r.sql not in held
    ]
    return train[:n_train], test


# --------------------------------------------------------------------------- the embedded default


def generated_generic(
    dbs_dir: Path,
    dbs: Databases,
    rng: random.Random,
    n_train: int,
    n_test: int,
    wordings: str = "varied",
) -> Split:
    """The embedded default's generic sets: databases built from the training themes (three
    of each) and their generated pairs, test questions new to training on those databases
    ('seen') and on databases of the held-out themes ('held out')."""
    seen: set[tuple[Path, str]] = set()
    instances = 3  # each theme appears with three different data sets
    train_themes = GENERIC_THEMES[:-HELD_OUT_THEMES]
    n_dbs = len(train_themes) * instances
    per_db = -(-n_train // n_dbs)
    extra = 3 * -(-(n_test // 2) // n_dbs)  # test candidates per db, before filtering
    train: list[Record] = []
    candidates: list[Record] = []
    for ti, theme in enumerate(train_themes):
        for inst in range(instances):
            path = dbs_dir / f"generic_{ti:02d}_{inst}.sqlite"
            build_database(path, theme, rng)
            got = generate_records(path, dbs, rng, per_db + extra, seen, wordings)
            tr, te = _split_pool(got, extra, per_db)  # every kind among the test candidates
            train += tr
            candidates += te
    rng.shuffle(train)
    train = train[:n_train]
    # A test question is new: neither its question nor its SQL appears in training on any
    # database (sibling databases of a theme share the schema, so text could repeat).
    trained = {norm_question(r.question) for r in train} | {r.sql for r in train}
    rng.shuffle(candidates)
    fresh = [
        r for r in candidates if norm_question(r.question) not in trained and r.sql not in trained
    ]
    test_seen = _stratified(fresh, n_test // 2)
    held: list[Record] = []
    for hi, theme in enumerate(GENERIC_THEMES[-HELD_OUT_THEMES:]):
        path = dbs_dir / f"generic_heldout_{hi:02d}.sqlite"
        build_database(path, theme, rng)
        held += generate_records(path, dbs, rng, 3 * (n_test - len(test_seen)), seen, wordings)
    rng.shuffle(held)
    return train, test_seen, _stratified(held, n_test - len(test_seen))


# --------------------------------------------------------------------------- an outside corpus


def outside_generic(
    d: Any, dbs: Databases, rng: random.Random, bad: list[str], dropped: list[str]
) -> Split:
    """Training and test pairs of a Spider/BIRD folder or a `{question, sql, db}` JSONL file.
    The test pairs are the `data.sql_generic_test_split` file's when the source has one,
    else those of a held-out share of the databases (`data.sql_generic_heldout_dbs`) plus new
    questions on the training databases; test pairs on a training database are 'seen',
    the others 'held out'."""
    records = check_records(_read_outside(d, bad), dbs, bad)
    rng.shuffle(records)
    test = [r for r in records if r.split == d.sql_generic_test_split]
    if test:
        train = [r for r in records if r.split != d.sql_generic_test_split]
    else:
        train, test = _hold_out_databases(d, records, rng)
    train = train[: d.sql_generic_pairs]
    test = _drop_repeats(test, train, dropped)
    train_dbs = {r.db for r in train}
    if d.sql_generic_generated:
        train += generated_beside(
            train, test, dbs, rng, d.sql_generic_generated, d.sql_generic_wordings
        )
    n = d.sql_generic_test_pairs
    seen = _stratified([r for r in test if r.db in train_dbs], n // 2)
    held = _stratified([r for r in test if r.db not in train_dbs], n - len(seen))
    if len(held) < n - len(seen):  # fewer held-out databases than asked: more seen ones
        seen = _stratified([r for r in test if r.db in train_dbs], n - len(held))
    return train, seen, held


def generated_beside(
    train: list[Record],
    test: list[Record],
    dbs: Databases,
    rng: random.Random,
    count: int,
    wordings: str = "varied",
) -> list[Record]:
    """Up to `count` pairs the generator writes over the databases `train` is on, in even
    shares and shuffled, none repeating a question or a SQL text of `train` on the same
    database, nor of `test` on any database (Spider's databases share table names: a held-out
    database's question could be written verbatim over a training one). A database the
    generator can ask little about gives fewer; the others do not make up for it."""
    seen: set[tuple[Path, str]] = set()
    for r in train + test:
        seen.update({(r.db, norm_question(r.question)), (r.db, r.sql), (r.db, norm_sql(r.sql))})
    tested = {norm_question(r.question) for r in test} | {norm_sql(r.sql) for r in test}
    paths = sorted({r.db for r in train})
    per_db = -(-count // len(paths)) if paths else 0
    out: list[Record] = []
    for path in paths:
        got = generate_records(path, dbs, rng, per_db, seen, wordings)
        out += [r for r in got if not {norm_question(r.question), norm_sql(r.sql)} & tested]
    rng.shuffle(out)
    return out[:count]


def _read_outside(d: Any, bad: list[str]) -> list[Record]:
    """The records of `data.sql_generic_source`: a Spider/BIRD folder or a JSONL file."""
    src = Path(d.sql_generic_source).expanduser()
    if src.is_dir():
        return read_corpus_folder(src, bad)
    if src.is_file():
        return read_jsonl(src, None, bad)
    raise InputError(
        f"data.sql_generic_source = {d.sql_generic_source!r}: no such file or folder"
        " (use 'generated', a Spider/BIRD folder or a JSONL file)"
    )


def _hold_out_databases(
    d: Any, records: list[Record], rng: random.Random
) -> tuple[list[Record], list[Record]]:
    """(training, test) of a source without a test split: every pair of a held-out share of
    the databases, and new questions on the others (sharing no text with their training)."""
    ids = sorted({r.db for r in records})
    rng.shuffle(ids)
    k = 0
    if len(ids) > 1 and d.sql_generic_heldout_dbs > 0:  # one at least, never all
        k = min(max(1, round(len(ids) * d.sql_generic_heldout_dbs)), len(ids) - 1)
    out_dbs = set(ids[:k])
    test = [r for r in records if r.db in out_dbs]
    rest = [r for r in records if r.db not in out_dbs]
    seen_test = _stratified(rest, d.sql_generic_test_pairs // 2, share=0.2)
    held_text = {norm_question(r.question) for r in seen_test} | {
        norm_sql(r.sql) for r in seen_test
    }
    train = [
        r
        for r in rest
        if r not in seen_test
        and norm_question(r.question) not in held_text
        and norm_sql(r.sql) not in held_text
    ]
    test += seen_test
    return train, test


def _drop_repeats(test: list[Record], train: list[Record], dropped: list[str]) -> list[Record]:
    """An outside corpus may repeat a question or a query across its splits: such test pairs
    are left out of the test (counted in `dropped`), since the user cannot be asked to fix
    Spider."""
    trained = {norm_question(r.question) for r in train} | {norm_sql(r.sql) for r in train}
    repeats = [
        r for r in test if norm_question(r.question) in trained or norm_sql(r.sql) in trained
    ]
    test = [r for r in test if r not in repeats]
    dropped.extend(
        f"{r.where}: test pair left out: its question or SQL is also a training one"
        for r in repeats
    )
    return test


# --------------------------------------------------------------------------- the domain


def domain_records(
    d: Any, dbs_dir: Path, dbs: Databases, rng: random.Random, bad: list[str]
) -> tuple[list[Record], list[Record], dict[str, str]]:
    """The domain's training and test pairs on dbs/domain.sqlite (or dbs/domain.url, the link
    to a server database): the user's database (a copy of a file, which is only read; a
    server's is read where it is) or the embedded default's, the user's pairs (weighted)
    and pairs generated from the database for the rest of `data.sql_domain_train_pairs`. The
    test set is only ever the user's pairs when there are any."""
    src: dict[str, str] = {}
    path = DomainDatabase.of(d).place(dbs_dir, rng, src)
    user_train, user_test = _user_pairs(d, path, dbs, bad, src)
    held = d.sql_domain_test
    if user_train and not user_test and _is_fraction(held or "0.3"):
        user_test, user_train = _split_user_pairs(d, user_train, rng, src)
    for r in user_test:
        r.weight = 1.0
    user_test = drop_trained_pairs(user_test, user_train, bad)
    seen = {(r.db, r.sql) for r in user_train + user_test}
    seen |= {(r.db, norm_sql(r.sql)) for r in user_train + user_test}
    seen |= {(r.db, norm_question(r.question)) for r in user_train + user_test}
    n_gen = max(0, d.sql_domain_train_pairs - len(user_train))
    if user_test:
        generated = generate_records(path, dbs, rng, n_gen, seen, d.sql_domain_wordings)
        test = user_test
    else:
        n_pool = n_gen + 3 * d.sql_domain_test_pairs
        pool = generate_records(path, dbs, rng, n_pool, seen, d.sql_domain_wordings)
        generated, test = _split_pool(pool, d.sql_domain_test_pairs, n_gen)
    src["domain_generated_pairs"] = str(len(generated))
    return user_train + generated, test, src


def _user_pairs(
    d: Any, path: Path, dbs: Databases, bad: list[str], src: dict[str, str]
) -> tuple[list[Record], list[Record]]:
    """The user's own training and test pairs of the domain that run on its database; bad
    ones are refused or counted (data.on_bad_record) before they are split."""
    user_train: list[Record] = []
    user_test: list[Record] = []
    if d.sql_domain_pairs:
        user_train = read_jsonl(
            Path(d.sql_domain_pairs).expanduser(), path, bad, d.sql_domain_pairs_weight
        )
        src["domain_pairs"] = d.sql_domain_pairs
    held = d.sql_domain_test
    if held and not _is_fraction(held):
        user_test = read_jsonl(Path(held).expanduser(), path, bad)
        src["domain_test"] = held
    user_train = check_records(user_train, dbs, bad)
    user_test = check_records(user_test, dbs, bad)
    settle(bad, d.on_bad_record, "the domain's pairs")  # before they are split
    if held and not _is_fraction(held) and not user_test:
        raise InputError(f"{held}: no usable test pair left (data.sql_domain_test)")
    return user_train, user_test


def _split_user_pairs(
    d: Any, user_train: list[Record], rng: random.Random, src: dict[str, str]
) -> tuple[list[Record], list[Record]]:
    """(test, training): the `data.sql_domain_test` share (0.3 unless given) of the user's
    pairs, drawn at random, held out for the test; pairs with the same SQL (`norm_sql`) go
    to the same side."""
    frac = float(d.sql_domain_test or "0.3")
    if len(user_train) < 2:
        raise InputError(
            f"{d.sql_domain_pairs}: one usable pair cannot be split into training and test:"
            " write more pairs, or give a test file (data.sql_domain_test)"
        )
    rng.shuffle(user_train)
    cut = min(len(user_train) - 1, max(1, round(len(user_train) * frac)))
    src["domain_test"] = f"{frac:g} of the user's pairs"
    # pairs that share their SQL (one query asked in other words) stay on one side, and
    # at least one query is left for training
    queries = {norm_sql(r.sql) for r in user_train}
    if len(queries) < 2:
        raise InputError(
            f"{d.sql_domain_pairs}: pairs that all have the same SQL cannot be split into"
            " training and test: write pairs of other queries, or give a test file"
            " (data.sql_domain_test)"
        )
    held: set[str] = set()
    for r in user_train[:cut]:
        if len(held) < len(queries) - 1:
            held.add(norm_sql(r.sql))
    test = [r for r in user_train if norm_sql(r.sql) in held]
    return test, [r for r in user_train if norm_sql(r.sql) not in held]


def _is_fraction(s: str) -> bool:
    try:
        return 0 < float(s) < 1
    except ValueError:
        return False

"""Question/SQL pairs generated from a database's own schema and rows.

One generator for every database: the embedded default's themes (moe/sql/sources.py builds their
databases first), a user's own sqlite file, a Spider database. It reads what
`inspect_database` found (tables, columns, keys, categorical values, numeric ranges) and
writes questions of five kinds, drawn evenly:

- filters: rows selected by a value or a comparison (`WHERE`, no aggregate),
- ordering: `ORDER BY` with or without `LIMIT`,
- aggregates: `COUNT`/`AVG`/`MIN`/`MAX`/`SUM`, filtered or not,
- grouping: `GROUP BY`, with `HAVING` or ordered by the group's size,
- joins: across a foreign key, filtered, grouped or aggregated.

Each table is read by moe/sql/roles.py for what it offers: a name-like label (a person's
first and last name together), numbers, categories, dates, other text, foreign keys. A table
that holds only a name and keys (an artist, a genre) is still asked about: in alphabetical
order, by a parent's key (`album WHERE artist_id = 22`), and across a join by its name ("the
tracks of the album Big Ones", "the artist of the album X", counts and aggregates of a named
parent's children). A date is ordered (earliest, latest), never asked as if it were a name.

Each template says its question in one of a few wordings, drawn evenly (`Tables._say`): one
that names what the SELECT lists ("List the names of tracks whose composer is X.") and plainer
ones people write ("Which tracks have composer X?", "Count the customers per country."),
where the table's label is what "which tracks" asks for, as in Spider's questions; with
`wordings="formal"` (`data.sql_generic_wordings`, `data.sql_domain_wordings`) the first alone,
drawing nothing for it, so the random draws are those made before the others came (the text
differs only where a glued name is now cut). A column whose name says what it holds is also
asked in the words that meaning gives, one time in two (`read`: "the 5 longest tracks", "tracks
that cost more than 0.99", "invoices from Paris", "the employee hired first";
moe/sql/roles.py `measure`, `place`, `done`). A name is
said in words (`Tables._words`): `unit_price` as "unit price", and a name glued in lower case
cut where the schema shows it (`billingcountry` as "billing country", moe/sql/roles.py `glued`).

Values come from the rows (a category that exists, a number inside the column's range), so
a question has an answer on this database. A kind the schema cannot express (no foreign key:
no joins) is left out. Every statement is executed by the caller before it is kept.

The templates are written once, in sqlite's SQL; for a database on a server each statement is
rewritten by sqlglot into the server's dialect (moe/sql/sandbox.py `in_dialect`): a table or column name that the
server folds or reserves is quoted (`"Track"`, `"order"` on PostgreSQL) and the meaning kept
where the dialects differ (sqlite sorts NULLs first, PostgreSQL last: `DESC NULLS LAST`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from moe.sql.joined import Joins
from moe.sql.roles import AGGS, Tables, Template, done, literal, plural
from moe.sql.sandbox import Schema, ident, in_dialect

KINDS = ("filters", "ordering", "aggregates", "grouping", "joins")
_AGGREGATES = ("COUNT(", "AVG(", "MIN(", "MAX(", "SUM(")


def kind_of(sql: str) -> str:
    """The kind of a query, for stratified test sets and the per-kind breakdown: joins
    (JOIN), grouping (GROUP BY), ordering (ORDER BY), aggregates (an aggregate function),
    filters (the rest)."""
    up = " ".join(sql.upper().split())
    if " JOIN " in up or re.search(r"\bFROM\s+\S+(\s+AS\s+\S+)?\s*,", up):
        return "joins"
    if "GROUP BY" in up:
        return "grouping"
    if "ORDER BY" in up:
        return "ordering"
    if any(a in up.replace(" (", "(") for a in _AGGREGATES):
        return "aggregates"
    return "filters"


class _Filters(Tables):
    """The `filters` templates: rows selected by a value or a comparison."""

    def _f_cat(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        v = self._cat_value(c, rng)
        return (
            self._say(
                rng,
                f"List the {self._lbl(r)} of {r.nouns} whose {self._words(c.name)} is {v}.",
                f"Which {r.nouns} have {self._words(c.name)} {v}?",
                f"Show the {r.nouns} whose {self._words(c.name)} is {v}.",
                read=self._from(r, c, v),
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {literal(v)}",
        )

    def _f_num(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        c = rng.choice(r.nums)
        op, op_w = self._op(rng)
        v = self._num_value(c, rng)
        return (
            self._say(
                rng,
                f"List the {self._lbl(r)} of {r.nouns} with {self._words(c.name)} {op_w} {v}.",
                f"Which {r.nouns} have {self._words(c.name)} {op_w} {v}?",
                f"Show the {r.nouns} whose {self._words(c.name)} is {op_w} {v}.",
                read=(w := self._compared(c, op)) and f"Which {r.nouns} {w} {v}?",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} WHERE {ident(c.name)} {op} {literal(v)}",
        )

    def _f_both(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        v, x = self._cat_value(c, rng), self._num_value(n, rng)
        op, op_w = self._op(rng)
        return (
            self._say(
                rng,
                f"Which {r.nouns} have {self._words(c.name)} {v} and {self._words(n.name)} {op_w} {x}? Give their {self._lbl(r)}.",
                f"Which {r.nouns} have {self._words(c.name)} {v} and {self._words(n.name)} {op_w} {x}?",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {literal(v)} AND {ident(n.name)} {op} {literal(x)}",
        )

    def _f_named(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "names")
        if not r:
            return None
        name = rng.choice(r.names)
        asked = [c for c in r.nums + r.cats if c is not name]
        if not asked:
            return None
        a = rng.choice(asked)
        v = self._cat_value(name, rng)
        return (
            self._say(
                rng,
                f"What is the {self._words(a.name)} of the {r.noun} whose {self._words(name.name)} is {v}?",
                f"What is the {self._words(a.name)} of the {r.noun} {v}?",
            ),
            f"SELECT {ident(a.name)} FROM {ident(r.table.name)} WHERE {ident(name.name)} = {literal(v)}",
        )

    def _f_distinct(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        op, op_w = self._op(rng)
        x = self._num_value(n, rng)
        return (
            self._say(
                rng,
                f"Which different {plural(self._words(c.name))} do {r.nouns} with {self._words(n.name)} {op_w} {x} have?",
                f"List the distinct {plural(self._words(c.name))} of {r.nouns} with {self._words(n.name)} {op_w} {x}.",
            ),
            f"SELECT DISTINCT {ident(c.name)} FROM {ident(r.table.name)} WHERE {ident(n.name)} {op} {literal(x)}",
        )

    def _f_attr(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "attrs")
        if not r:
            return None
        c = rng.choice(r.attrs)
        v = self._any_value(c, rng)
        return (
            self._say(
                rng,
                f"Which {r.nouns} have {self._words(c.name)} {v}? Give their {self._lbl(r)}.",
                f"Which {r.nouns} have {self._words(c.name)} {v}?",
                f"List the {r.nouns} whose {self._words(c.name)} is {v}.",
                read=self._from(r, c, v),
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {literal(v)}",
        )

    def _f_key(self, rng: random.Random) -> tuple[str, str] | None:
        """Rows of one parent, named by its key as the child stores it (`artist_id = 22`)."""
        r = self._pick(rng, "fks")
        if not r:
            return None
        c = rng.choice(r.fks)
        assert c.references is not None
        parent, v = self._words(c.references[0]), self._any_value(c, rng)
        return (
            self._say(
                rng,
                f"List the {self._lbl(r)} of the {r.nouns} of {parent} {v}.",
                f"Which {r.nouns} belong to {parent} {v}?",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {literal(v)}",
        )


class _Ordering(Tables):
    """The `ordering` templates: `ORDER BY`, with or without `LIMIT`."""

    def _o_top(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        k = rng.randint(2, 10)
        high = rng.random() < 0.5
        return (
            self._say(
                rng,
                f"Show the {self._lbl(r)} of the {k} {r.nouns} with the {'highest' if high else 'lowest'} {self._words(n.name)}.",
                f"What are the {k} {r.nouns} with the {'largest' if high else 'smallest'} {self._words(n.name)}?",
                f"Show the {'top' if high else 'bottom'} {k} {r.nouns} by {self._words(n.name)}.",
                read=(w := self._extreme(n, high)) and f"What are the {k} {w} {r.nouns}?",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} ORDER BY {ident(n.name)} {'DESC' if high else 'ASC'} LIMIT {k}",
        )

    def _o_one(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        high = rng.random() < 0.5
        return (
            self._say(
                rng,
                f"What is the {r.label_words} of the {r.noun} with the {'highest' if high else 'lowest'} {self._words(n.name)}?",
                f"Which {r.noun} has the {'largest' if high else 'smallest'} {self._words(n.name)}?",
                read=(w := self._extreme(n, high)) and f"What is the {w} {r.noun}?",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} ORDER BY {ident(n.name)} {'DESC' if high else 'ASC'} LIMIT 1",
        )

    def _o_sorted(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        v = self._cat_value(c, rng)
        high = rng.random() < 0.5
        return (
            self._say(
                rng,
                f"List the {self._lbl(r)} of {r.nouns} whose {self._words(c.name)} is {v}, from {'highest' if high else 'lowest'} to {'lowest' if high else 'highest'} {self._words(n.name)}.",
                f"Show the {r.nouns} with {self._words(c.name)} {v}, sorted by {self._words(n.name)} in {'descending' if high else 'ascending'} order.",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {literal(v)} ORDER BY {ident(n.name)} {'DESC' if high else 'ASC'}",
        )

    def _o_alpha(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "named")
        if not r:
            return None
        by = r.labels[-1]  # a person: by last name
        desc = rng.random() < 0.3
        return (
            self._say(
                rng,
                f"List the {self._lbl(r)} of {r.nouns} in {'reverse ' if desc else ''}alphabetical order.",
                f"List the {r.nouns} in {'reverse ' if desc else ''}alphabetical order.",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)} ORDER BY {ident(by.name)}{' DESC' if desc else ''}",
        )

    def _o_date(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "dates")
        if not r:
            return None
        c = rng.choice(r.dates)
        first = rng.random() < 0.5
        known = f" WHERE {ident(c.name)} IS NOT NULL" if c.nulls else ""
        return (
            self._say(
                rng,
                f"Which {r.noun} has the {'earliest' if first else 'latest'} {self._words(c.name)}? Give its {r.label_words}.",
                f"Which {r.noun} has the {'earliest' if first else 'latest'} {self._words(c.name)}?",
                read=(w := done(c.name))
                and f"Which {r.noun} {w} {'first' if first else 'most recently'}?",
            ),
            f"SELECT {self._sel(r)} FROM {ident(r.table.name)}{known} ORDER BY {ident(c.name)} {'ASC' if first else 'DESC'} LIMIT 1",
        )


class _Aggregates(Tables):
    """The `aggregates` templates: `COUNT`/`AVG`/`MIN`/`MAX`/`SUM`."""

    def _a_count(self, rng: random.Random) -> tuple[str, str] | None:
        r = rng.choice(list(self.roles.values())) if self.roles else None
        if not r:
            return None
        asked = self._say(rng, f"How many {r.nouns} are there?", f"Count the {r.nouns}.")
        return asked, f"SELECT COUNT(*) FROM {ident(r.table.name)}"

    def _a_count_cat(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        v = self._cat_value(c, rng)
        return (
            self._say(
                rng,
                f"How many {r.nouns} have {self._words(c.name)} {v}?",
                f"How many {r.nouns} are there whose {self._words(c.name)} is {v}?",
                read=self._from(r, c, v, "How many {} are from {}?"),
            ),
            f"SELECT COUNT(*) FROM {ident(r.table.name)} WHERE {ident(c.name)} = {literal(v)}",
        )

    def _a_count_num(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        op, op_w = self._op(rng)
        x = self._num_value(n, rng)
        return (
            self._say(
                rng,
                f"How many {r.nouns} have {self._words(n.name)} {op_w} {x}?",
                f"Count the {r.nouns} whose {self._words(n.name)} is {op_w} {x}.",
            ),
            f"SELECT COUNT(*) FROM {ident(r.table.name)} WHERE {ident(n.name)} {op} {literal(x)}",
        )

    def _a_agg(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        agg, agg_w = rng.choice(AGGS)
        return (
            self._say(
                rng,
                f"What is the {agg_w} {self._words(n.name)} of {r.nouns}?",
                f"What is the {agg_w} {r.noun} {self._words(n.name)}?",
            ),
            f"SELECT {agg}({ident(n.name)}) FROM {ident(r.table.name)}",
        )

    def _a_agg_cat(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        agg, agg_w = rng.choice(AGGS)
        v = self._cat_value(c, rng)
        return (
            self._say(
                rng,
                f"What is the {agg_w} {self._words(n.name)} of {r.nouns} whose {self._words(c.name)} is {v}?",
                f"What is the {agg_w} {r.noun} {self._words(n.name)} for {self._words(c.name)} {v}?",
            ),
            f"SELECT {agg}({ident(n.name)}) FROM {ident(r.table.name)} WHERE {ident(c.name)} = {literal(v)}",
        )

    def _a_distinct(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        return (
            self._say(
                rng,
                f"How many different {plural(self._words(c.name))} do {r.nouns} have?",
                f"Count the distinct {plural(self._words(c.name))} of {r.nouns}.",
            ),
            f"SELECT COUNT(DISTINCT {ident(c.name)}) FROM {ident(r.table.name)}",
        )


class _Grouping(Tables):
    """The `grouping` templates: `GROUP BY`, with `HAVING` or ordered."""

    def _g_count(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        return (
            self._say(
                rng,
                f"How many {r.nouns} are there for each {self._words(c.name)}?",
                f"How many {r.nouns} does each {self._words(c.name)} have?",
                f"Count the {r.nouns} per {self._words(c.name)}.",
            ),
            f"SELECT {ident(c.name)}, COUNT(*) FROM {ident(r.table.name)} GROUP BY {ident(c.name)}",
        )

    def _g_agg(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        agg, agg_w = rng.choice(AGGS)
        return (
            self._say(
                rng,
                f"What is the {agg_w} {self._words(n.name)} of {r.nouns} for each {self._words(c.name)}?",
                f"What is the {agg_w} {self._words(n.name)} per {self._words(c.name)}?",
            ),
            f"SELECT {ident(c.name)}, {agg}({ident(n.name)}) FROM {ident(r.table.name)} GROUP BY {ident(c.name)}",
        )

    def _g_having(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        k = rng.randint(1, max(1, r.table.rows // max(c.distinct, 1)))
        return (
            self._say(
                rng,
                f"Which {plural(self._words(c.name))} have more than {k} {r.nouns}?",
                f"List the {plural(self._words(c.name))} with more than {k} {r.nouns}.",
            ),
            f"SELECT {ident(c.name)} FROM {ident(r.table.name)} GROUP BY {ident(c.name)} HAVING COUNT(*) > {k}",
        )

    def _g_most(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        most = rng.random() < 0.5
        return (
            self._say(
                rng,
                f"Which {self._words(c.name)} has the {'most' if most else 'fewest'} {r.nouns}?",
                f"Which {self._words(c.name)} has the {'largest' if most else 'smallest'} number of {r.nouns}?",
            ),
            f"SELECT {ident(c.name)} FROM {ident(r.table.name)} GROUP BY {ident(c.name)} ORDER BY COUNT(*) {'DESC' if most else 'ASC'} LIMIT 1",
        )


class QuestionGenerator(_Filters, _Ordering, _Aggregates, _Grouping, Joins):
    """An endless stream of (question, SQL in sqlite's dialect) over one database's schema,
    the kinds drawn in turn; `kinds` says which the schema supports, `in_dialect` rewrites a
    statement for the database's own engine."""

    def __init__(self, schema: Schema, wordings: str = "varied") -> None:
        super().__init__(schema, wordings)
        self.templates: dict[str, list[Template]] = {
            "filters": [self._f_cat, self._f_num, self._f_both, self._f_named, self._f_distinct,
                        self._f_attr, self._f_key],
            "ordering": [self._o_top, self._o_one, self._o_sorted, self._o_alpha, self._o_date],
            "aggregates": [self._a_count, self._a_count_cat, self._a_count_num, self._a_agg,
                           self._a_agg_cat, self._a_distinct],
            "grouping": [self._g_count, self._g_agg, self._g_having, self._g_most],
            "joins": [self._j_names, self._j_count, self._j_agg, self._j_child, self._j_num,
                      self._j_of_parent, self._j_parent_of, self._j_count_in, self._j_agg_in],
        }  # fmt: skip
        probe = random.Random(0)
        self.kinds = [k for k in KINDS if any(self._try(t, probe) for t in self.templates[k] * 4)]

    def in_dialect(self, sql: str) -> str:
        """A statement of the stream (sqlite's SQL) as the database's engine reads it
        (moe/sql/sandbox.py `in_dialect`; unchanged for sqlite)."""
        return in_dialect(sql, self.schema)

    @staticmethod
    def _try(t: Template, rng: random.Random) -> tuple[str, str] | None:
        return t(rng)

    def stream(self, rng: random.Random) -> Iterator[tuple[str, str]]:
        if not self.kinds:
            return
        while True:
            for kind in self.kinds:
                for _ in range(20):  # a template may not apply to the table it drew
                    got = rng.choice(self.templates[kind])(rng)
                    if got:
                        yield got
                        break

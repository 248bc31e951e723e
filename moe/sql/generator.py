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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from moe.sql.sandbox import Column, Schema, Table, ident, in_dialect

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


def words(name: str) -> str:
    """A column or table name as words: `unit_price` and `UnitPrice` -> 'unit price'."""
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)
    return " ".join(s.replace("_", " ").split()).lower()


def plural(phrase: str) -> str:
    w = phrase
    if re.search(r"(s|x|z|ch|sh)$", w):
        return w + "es"
    if re.search(r"[^aeiou]y$", w):
        return w[:-1] + "ies"
    return w + "s"


def article(word: str) -> str:
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def _literal(v: object) -> str:
    if isinstance(v, float):
        return repr(round(v, 2))
    if isinstance(v, (int, bool)):
        return str(v)
    s = str(v)  # text, and a date or time of a server's column: a quoted literal
    return "'" + s.replace("'", "''") + "'"


_OPS = [(">", "greater than"), ("<", "less than"), (">=", "at least"), ("<=", "at most")]
_AGGS = [("AVG", "average"), ("MAX", "maximum"), ("MIN", "minimum"), ("SUM", "total")]


@dataclass
class _Role:
    """What a table offers the templates."""

    table: Table
    noun: str  # singular words
    nouns: str  # plural
    label: Column  # what a question asks for (a name-like column, else the key)
    key: Column | None
    nums: list[Column]
    cats: list[Column]
    names: list[Column]  # text columns with mostly distinct values (a row's name)


def _roles(schema: Schema) -> dict[str, _Role]:
    out = {}
    for t in schema.tables:
        if not t.rows or not t.columns:
            continue
        key = next((c for c in t.columns if c.pk), None)
        fk_cols = {c.name for c in t.columns if c.references}
        free = [c for c in t.columns if not c.pk and c.name not in fk_cols]
        nums = [c for c in free if c.numeric and c.distinct > 1 and not _id_like(c)]
        cats = [c for c in free if c.categorical and not c.references]
        names = [
            c
            for c in free
            if not c.numeric and c.values and c.distinct >= max(2, t.rows // 2) and c not in cats
        ]
        named = [c for c in names if re.search(r"name|title", c.name, re.I)]
        label = (named or names or ([key] if key else []) or t.columns)[0]
        noun = words(t.name)
        out[t.name] = _Role(t, noun, plural(noun), label, key, nums, cats, names)
    return out


def _id_like(c: Column) -> bool:
    return bool(re.search(r"(^|_)id$|Id$|ID$", c.name))


Template = Callable[[random.Random], tuple[str, str] | None]


class _Tables:
    """What a database's schema offers the templates: each table's role, the foreign keys
    to join on, and the pieces every template uses."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.roles = _roles(schema)
        self.joins = [
            (self.roles[child], fk, self.roles[parent], pcol)
            for child, fk, parent, pcol in schema.foreign_keys
            if child in self.roles and parent in self.roles and child != parent
        ]

    def _pick(self, rng: random.Random, need: str) -> _Role | None:
        ok = [r for r in self.roles.values() if getattr(r, need)]
        return rng.choice(ok) if ok else None

    @staticmethod
    def _num_value(c: Column, rng: random.Random) -> object:
        if c.lo is None or c.hi is None:
            return rng.choice(c.values)
        if isinstance(c.lo, int) and isinstance(c.hi, int):
            return rng.randint(c.lo, c.hi) if rng.random() < 0.5 else rng.choice(c.values)
        return round(rng.uniform(float(c.lo), float(c.hi)), 2)

    @staticmethod
    def _cat_value(c: Column, rng: random.Random) -> object:
        return rng.choice(c.values[:30])

    def _lbl(self, r: _Role) -> str:
        return plural(words(r.label.name))

    def _join(self, rng: random.Random) -> tuple[_Role, str, _Role, str, str] | None:
        if not self.joins:
            return None
        child, fk, parent, pcol = rng.choice(self.joins)
        on = (
            f"{ident(parent.table.name)} AS T1 JOIN {ident(child.table.name)} AS T2"
            f" ON T1.{ident(pcol)} = T2.{ident(fk)}"
        )
        return child, fk, parent, pcol, on


class _Filters(_Tables):
    """The `filters` templates: rows selected by a value or a comparison."""

    def _f_cat(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        v = self._cat_value(c, rng)
        return (
            f"List the {self._lbl(r)} of {r.nouns} whose {words(c.name)} is {v}.",
            f"SELECT {ident(r.label.name)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {_literal(v)}",
        )

    def _f_num(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        c = rng.choice(r.nums)
        op, op_w = rng.choice(_OPS)
        v = self._num_value(c, rng)
        return (
            f"List the {self._lbl(r)} of {r.nouns} with {words(c.name)} {op_w} {v}.",
            f"SELECT {ident(r.label.name)} FROM {ident(r.table.name)} WHERE {ident(c.name)} {op} {_literal(v)}",
        )

    def _f_both(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        v, x = self._cat_value(c, rng), self._num_value(n, rng)
        op, op_w = rng.choice(_OPS)
        return (
            f"Which {r.nouns} have {words(c.name)} {v} and {words(n.name)} {op_w} {x}? Give their {self._lbl(r)}.",
            f"SELECT {ident(r.label.name)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {_literal(v)} AND {ident(n.name)} {op} {_literal(x)}",
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
            f"What is the {words(a.name)} of the {r.noun} whose {words(name.name)} is {v}?",
            f"SELECT {ident(a.name)} FROM {ident(r.table.name)} WHERE {ident(name.name)} = {_literal(v)}",
        )

    def _f_distinct(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        op, op_w = rng.choice(_OPS)
        x = self._num_value(n, rng)
        return (
            f"Which different {plural(words(c.name))} do {r.nouns} with {words(n.name)} {op_w} {x} have?",
            f"SELECT DISTINCT {ident(c.name)} FROM {ident(r.table.name)} WHERE {ident(n.name)} {op} {_literal(x)}",
        )


class _Ordering(_Tables):
    """The `ordering` templates: `ORDER BY`, with or without `LIMIT`."""

    def _o_top(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        k = rng.randint(2, 10)
        high = rng.random() < 0.5
        return (
            f"Show the {self._lbl(r)} of the {k} {r.nouns} with the {'highest' if high else 'lowest'} {words(n.name)}.",
            f"SELECT {ident(r.label.name)} FROM {ident(r.table.name)} ORDER BY {ident(n.name)} {'DESC' if high else 'ASC'} LIMIT {k}",
        )

    def _o_one(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        high = rng.random() < 0.5
        return (
            f"What is the {words(r.label.name)} of the {r.noun} with the {'highest' if high else 'lowest'} {words(n.name)}?",
            f"SELECT {ident(r.label.name)} FROM {ident(r.table.name)} ORDER BY {ident(n.name)} {'DESC' if high else 'ASC'} LIMIT 1",
        )

    def _o_sorted(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        v = self._cat_value(c, rng)
        high = rng.random() < 0.5
        return (
            f"List the {self._lbl(r)} of {r.nouns} whose {words(c.name)} is {v}, from {'highest' if high else 'lowest'} to {'lowest' if high else 'highest'} {words(n.name)}.",
            f"SELECT {ident(r.label.name)} FROM {ident(r.table.name)} WHERE {ident(c.name)} = {_literal(v)} ORDER BY {ident(n.name)} {'DESC' if high else 'ASC'}",
        )


class _Aggregates(_Tables):
    """The `aggregates` templates: `COUNT`/`AVG`/`MIN`/`MAX`/`SUM`."""

    def _a_count(self, rng: random.Random) -> tuple[str, str] | None:
        r = rng.choice(list(self.roles.values())) if self.roles else None
        if not r:
            return None
        return f"How many {r.nouns} are there?", f"SELECT COUNT(*) FROM {ident(r.table.name)}"

    def _a_count_cat(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        v = self._cat_value(c, rng)
        return (
            f"How many {r.nouns} have {words(c.name)} {v}?",
            f"SELECT COUNT(*) FROM {ident(r.table.name)} WHERE {ident(c.name)} = {_literal(v)}",
        )

    def _a_count_num(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        op, op_w = rng.choice(_OPS)
        x = self._num_value(n, rng)
        return (
            f"How many {r.nouns} have {words(n.name)} {op_w} {x}?",
            f"SELECT COUNT(*) FROM {ident(r.table.name)} WHERE {ident(n.name)} {op} {_literal(x)}",
        )

    def _a_agg(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "nums")
        if not r:
            return None
        n = rng.choice(r.nums)
        agg, agg_w = rng.choice(_AGGS)
        return (
            f"What is the {agg_w} {words(n.name)} of {r.nouns}?",
            f"SELECT {agg}({ident(n.name)}) FROM {ident(r.table.name)}",
        )

    def _a_agg_cat(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        agg, agg_w = rng.choice(_AGGS)
        v = self._cat_value(c, rng)
        return (
            f"What is the {agg_w} {words(n.name)} of {r.nouns} whose {words(c.name)} is {v}?",
            f"SELECT {agg}({ident(n.name)}) FROM {ident(r.table.name)} WHERE {ident(c.name)} = {_literal(v)}",
        )

    def _a_distinct(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        return (
            f"How many different {plural(words(c.name))} do {r.nouns} have?",
            f"SELECT COUNT(DISTINCT {ident(c.name)}) FROM {ident(r.table.name)}",
        )


class _Grouping(_Tables):
    """The `grouping` templates: `GROUP BY`, with `HAVING` or ordered."""

    def _g_count(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        return (
            f"How many {r.nouns} are there for each {words(c.name)}?",
            f"SELECT {ident(c.name)}, COUNT(*) FROM {ident(r.table.name)} GROUP BY {ident(c.name)}",
        )

    def _g_agg(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r or not r.nums:
            return None
        c, n = rng.choice(r.cats), rng.choice(r.nums)
        agg, agg_w = rng.choice(_AGGS)
        return (
            f"What is the {agg_w} {words(n.name)} of {r.nouns} for each {words(c.name)}?",
            f"SELECT {ident(c.name)}, {agg}({ident(n.name)}) FROM {ident(r.table.name)} GROUP BY {ident(c.name)}",
        )

    def _g_having(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        k = rng.randint(1, max(1, r.table.rows // max(c.distinct, 1)))
        return (
            f"Which {plural(words(c.name))} have more than {k} {r.nouns}?",
            f"SELECT {ident(c.name)} FROM {ident(r.table.name)} GROUP BY {ident(c.name)} HAVING COUNT(*) > {k}",
        )

    def _g_most(self, rng: random.Random) -> tuple[str, str] | None:
        r = self._pick(rng, "cats")
        if not r:
            return None
        c = rng.choice(r.cats)
        most = rng.random() < 0.5
        return (
            f"Which {words(c.name)} has the {'most' if most else 'fewest'} {r.nouns}?",
            f"SELECT {ident(c.name)} FROM {ident(r.table.name)} GROUP BY {ident(c.name)} ORDER BY COUNT(*) {'DESC' if most else 'ASC'} LIMIT 1",
        )


class _Joins(_Tables):
    """The `joins` templates: across a foreign key."""

    def _j_names(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[0].cats:
            return None
        child, _, parent, _, on = j
        c = rng.choice(child.cats)
        v = self._cat_value(c, rng)
        return (
            f"List the {self._lbl(parent)} of {parent.nouns} that have {article(child.noun)} with {words(c.name)} {v}.",
            f"SELECT DISTINCT T1.{ident(parent.label.name)} FROM {on} WHERE T2.{ident(c.name)} = {_literal(v)}",
        )

    def _j_count(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j:
            return None
        child, _, parent, pcol, on = j
        return (
            f"How many {child.nouns} does each {parent.noun} have? Show the {words(parent.label.name)} and count.",
            f"SELECT T1.{ident(parent.label.name)}, COUNT(*) FROM {on} GROUP BY T1.{ident(pcol)}",
        )

    def _j_agg(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[0].nums or not j[2].cats:
            return None
        child, _, parent, _, on = j
        n, c = rng.choice(child.nums), rng.choice(parent.cats)
        agg, agg_w = rng.choice(_AGGS)
        v = self._cat_value(c, rng)
        return (
            f"What is the {agg_w} {words(n.name)} of {child.nouns} for {parent.nouns} whose {words(c.name)} is {v}?",
            f"SELECT {agg}(T2.{ident(n.name)}) FROM {on} WHERE T1.{ident(c.name)} = {_literal(v)}",
        )

    def _j_child(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[2].cats:
            return None
        child, _, parent, _, on = j
        c = rng.choice(parent.cats)
        v = self._cat_value(c, rng)
        return (
            f"List the {self._lbl(child)} of {child.nouns} whose {parent.noun} has {words(c.name)} {v}.",
            f"SELECT T2.{ident(child.label.name)} FROM {on} WHERE T1.{ident(c.name)} = {_literal(v)}",
        )

    def _j_num(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[2].nums:
            return None
        child, _, parent, _, on = j
        n = rng.choice(parent.nums)
        op, op_w = rng.choice(_OPS)
        x = self._num_value(n, rng)
        return (
            f"How many {child.nouns} belong to {parent.nouns} with {words(n.name)} {op_w} {x}?",
            f"SELECT COUNT(*) FROM {on} WHERE T1.{ident(n.name)} {op} {_literal(x)}",
        )


class QuestionGenerator(_Filters, _Ordering, _Aggregates, _Grouping, _Joins):
    """An endless stream of (question, SQL in sqlite's dialect) over one database's schema,
    the kinds drawn in turn; `kinds` says which the schema supports, `in_dialect` rewrites a
    statement for the database's own engine."""

    def __init__(self, schema: Schema) -> None:
        super().__init__(schema)
        self.templates: dict[str, list[Template]] = {
            "filters": [self._f_cat, self._f_num, self._f_both, self._f_named, self._f_distinct],
            "ordering": [self._o_top, self._o_one, self._o_sorted],
            "aggregates": [self._a_count, self._a_count_cat, self._a_count_num, self._a_agg,
                           self._a_agg_cat, self._a_distinct],
            "grouping": [self._g_count, self._g_agg, self._g_having, self._g_most],
            "joins": [self._j_names, self._j_count, self._j_agg, self._j_child, self._j_num],
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

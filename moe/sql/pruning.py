"""Schema pruning: the part of a database's schema that one question needs, when the whole
schema does not fit the model's context (the approach of CodeS and RESDSQL's schema
filters, without a trained classifier).

Tables and columns are ranked for a question by their names (the words of `Album.Title`
against the question's words) and by the values the database holds (a question that says
"Canada" finds `Customer.Country`, which holds it). Tables are then kept in rank order while
the example fits; a table too wide on its own keeps its keys and its best-ranked columns.
When training, the tables the gold SQL reads are always kept (the model must see what the
answer uses); at evaluation only the question decides, as for a user's question at `ask`.
What was left out is recorded with the example.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from moe.sql.sandbox import ReadOnlyDb, Schema, SchemaStyle, Table, ident, serialize_schema

# Distinct values read per text column for the value index (bounded queries: a large table
# is sampled, not scanned).
VALUES_PER_COLUMN = 2000
SAMPLE_ROWS = 50_000
_WORD = re.compile(r"[a-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
# Words a question uses for everything: they match no table.
_STOP = set(
    """a an the of in on at to for by with from and or is are was were be been what which who
    whom whose how many much list show give find all each every that those these there their
    its it as per than more most less least number count name names do does did have has had
    not no any some me return get""".split()
)


def _stem(w: str) -> str:
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 3 and w.endswith("es") and w[-3] in "sxz":
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
        return w[:-1]
    return w


def words(text: str) -> set[str]:
    """The stemmed content words of a question or a name (`InvoiceLine` -> invoice, line)."""
    text = _CAMEL.sub(" ", text).replace("_", " ").lower()
    return {_stem(w) for w in _WORD.findall(text) if w not in _STOP}


def phrase(text: str) -> str:
    """`text` as the value index compares it: its lower-case words, one space apart, with a
    space either side."""
    return " " + " ".join(_WORD.findall(text.lower())) + " "


@dataclass
class ValueIndex:
    """Text values of each column, lower-cased, for finding a question's values:
    `{(table, column): values}`; `raw` gives each lower-cased value as the database writes it
    (for showing it to the model: moe/sql/values.py)."""

    values: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    raw: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    # each value under its first word, built at the first `hits`
    _first: dict[str, list[tuple[tuple[str, str], str]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # the columns holding each value, built at the first `holding`
    _holders: dict[str, list[tuple[str, str]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def of_texts(cls, texts: dict[tuple[str, str], list[str]]) -> ValueIndex:
        """The index of each column's text values as the database holds them (values of
        fewer than 2 characters once compared are left out, but a column read stays, if
        empty; one value per text read, so that a count of them says how much of the column
        was read: moe/sql/grounding.py). Of several texts compared alike ('Rock', 'ROCK') `raw`
        keeps the first in sort order, whatever order the database returned them in."""
        values: dict[tuple[str, str], list[str]] = {}
        raw: dict[tuple[str, str], dict[str, str]] = {}
        for key, vals in texts.items():
            if not vals:
                continue
            pairs = [(p, v) for v in vals if len(p := phrase(v).strip()) >= 2]
            values[key], raw[key] = [p for p, _ in pairs], {}
            for p, v in pairs:
                raw[key][p] = min(raw[key].get(p, v), v)
        return cls(values, raw)

    def holding(self, value: str) -> list[tuple[str, str]]:
        """The columns holding `value` (as the index compares it)."""
        if self._holders is None:
            holders: dict[str, list[tuple[str, str]]] = {}
            for key, vals in self.values.items():
                for v in dict.fromkeys(vals):
                    holders.setdefault(v, []).append(key)
            self._holders = holders
        return self._holders.get(value, [])

    @classmethod
    def build(
        cls, db: ReadOnlyDb, schema: Schema, per_column: int = VALUES_PER_COLUMN
    ) -> ValueIndex:
        """Read through the sandbox with bounded queries: at most `per_column` distinct text
        values of each non-key text column, from at most 50,000 rows of its table."""
        out: dict[tuple[str, str], list[str]] = {}
        for t in schema.tables:
            for c in t.columns:
                if c.numeric or c.pk or c.references is not None:
                    continue
                q = (
                    f"SELECT DISTINCT v FROM (SELECT {ident(c.name)} AS v FROM {ident(t.name)}"
                    f" LIMIT {SAMPLE_ROWS}) WHERE typeof(v) = 'text' AND length(v) BETWEEN 2"
                    f" AND 60 LIMIT {min(per_column, db.row_limit)}"
                )
                got = db.run(q)
                if got.ok and got.rows:
                    out[(t.name, c.name)] = [str(v) for (v,) in got.rows]
        return cls.of_texts(out)

    def hits(self, question: str) -> dict[tuple[str, str], list[str]]:
        """The columns holding a value the question names (whole words), with the values
        (each once). Looked up by the question's words: a value's first word must be one."""
        q = phrase(question)
        if self._first is None:
            first: dict[str, list[tuple[tuple[str, str], str]]] = {}
            for key, vals in self.values.items():
                for v in dict.fromkeys(vals):
                    first.setdefault(v.split(" ", 1)[0], []).append((key, v))
            self._first = first
        found: dict[tuple[str, str], list[str]] = {}
        for w in dict.fromkeys(q.split()):
            for key, v in self._first.get(w, ()):
                # a one-word value must not be a stop word or a short number ("a", "1")
                if f" {v} " in q and (" " in v or (v not in _STOP and not v.isdigit())):
                    found.setdefault(key, []).append(v)
        return found


@dataclass
class Ranking:
    """Tables best first, and each table's columns best first, for one question."""

    tables: list[str]
    columns: dict[str, list[str]]
    scores: dict[str, float]


def rank(schema: Schema, question: str, index: ValueIndex | None = None) -> Ranking:
    """Rank the tables and columns of `schema` for `question`: a name's share of words the
    question uses, a value the question names (worth more than a name), and a table linked by
    a foreign key to a named one ranked next to it (a question about invoices of customers
    needs the table between them)."""
    qw = words(question)
    hits = index.hits(question) if index else {}

    def name_score(name: str) -> float:
        w = words(name)
        return len(w & qw) / len(w) if w else 0.0

    col_scores: dict[str, dict[str, float]] = {}
    table_scores: dict[str, float] = {}
    for t in schema.tables:
        cs = {
            c.name: name_score(c.name) + 2.0 * bool(hits.get((t.name, c.name))) for c in t.columns
        }
        col_scores[t.name] = cs
        table_scores[t.name] = 2.0 * name_score(t.name) + max(cs.values(), default=0.0)
    # a neighbour of a named table (by a foreign key either way) gets a share of its score
    # and a table between two named ones (album between track and artist) most of theirs
    linked = dict(table_scores)
    near: dict[str, list[float]] = {n: [] for n in linked}
    for child, _, parent, _ in schema.foreign_keys:
        if child in linked and parent in linked and child != parent:
            near[child].append(table_scores[parent])
            near[parent].append(table_scores[child])
    for n, scores in near.items():
        top = sorted(scores, reverse=True)
        if top:
            linked[n] = max(linked[n], 0.3 * top[0])
        if len(top) > 1 and top[1] > 0:
            linked[n] = max(linked[n], 0.75 * top[1])
    order = {t.name: i for i, t in enumerate(schema.tables)}
    tables = sorted(order, key=lambda n: (-linked[n], order[n]))
    columns = {
        t.name: [
            c.name
            for _, c in sorted(
                enumerate(t.columns),
                key=lambda ic: (
                    -(ic[1].pk or ic[1].references is not None),
                    -col_scores[t.name][ic[1].name],
                    ic[0],
                ),
            )
        ]
        for t in schema.tables
    }
    return Ranking(tables, columns, linked)


def gold_tables(sql: str, schema: Schema) -> set[str]:
    """The schema's tables that `sql` reads (by sqlglot's parse; CTE names are not tables).
    Unparseable SQL gives every table whose name appears in it as a word."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    by_lower = {t.name.lower(): t.name for t in schema.tables}
    try:
        tree = sqlglot.parse_one(sql, read="sqlite")
    except (SqlglotError, ValueError, RecursionError):
        found = {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sql)}
        return {by_lower[w] for w in found if w in by_lower}
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    names = {t.name.lower() for t in tree.find_all(exp.Table)} - ctes
    return {by_lower[n] for n in names if n in by_lower}


@dataclass
class Pruned:
    """A schema cut for one example: its text, what was left out (for the example's record),
    and whether it is the whole schema."""

    text: str
    note: str
    kept_tables: list[str]
    gold_kept: bool = True  # the gold SQL's tables all kept (set by the caller that knows it)


def _subschema(schema: Schema, keep: dict[str, list[str] | None]) -> Schema:
    """`schema` with only the tables in `keep` (in the database's order) and, where a list is
    given, only those columns (in the table's order)."""
    tables = []
    for t in schema.tables:
        if t.name not in keep:
            continue
        cols = keep[t.name]
        tables.append(
            Table(t.name, [c for c in t.columns if cols is None or c.name in cols], t.rows)
        )
    return dataclasses.replace(schema, tables=tables)  # the dialect and namespace kept


def prune(
    schema: Schema,
    ranking: Ranking,
    style: SchemaStyle,
    fits: Callable[[str], bool],
    required: set[str] = frozenset(),  # type: ignore[assignment]
) -> Pruned | None:
    """The largest cut of `schema` that `fits`: the `required` tables and then tables in
    rank order, each whole; when not even the first table(s) fit whole, the last table keeps
    its keys and its best-ranked columns. None when nothing fits (not even the required
    tables' keys)."""
    first = [n for n in ranking.tables if n in required]
    rest = [n for n in ranking.tables if n not in required]
    order = first + rest

    def text(keep: dict[str, list[str] | None]) -> str:
        return serialize_schema(_subschema(schema, keep), style)

    # the longest prefix of `order` whose tables fit whole (fitting only shrinks as tables
    # are added: binary search)
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text(dict.fromkeys(order[:mid]))):
            lo = mid
        else:
            hi = mid - 1
    need = max(len(first), 1)
    if lo >= need:
        keep: dict[str, list[str] | None] = dict.fromkeys(order[:lo])
    else:
        # the first `need` tables, whole but for the last one built up column by column
        whole = dict.fromkeys(order[: need - 1])
        last = order[need - 1]
        cols = ranking.columns[last]
        lo, hi = 0, len(cols)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(text({**whole, last: cols[:mid]})):
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        keep = {**whole, last: cols[:lo]}
    cut_tables = [t.name for t in schema.tables if t.name not in keep]
    cut_cols = sum(len(schema.table(n).columns) - len(c) for n, c in keep.items() if c is not None)
    parts = []
    if cut_tables:
        parts.append(f"tables {', '.join(cut_tables)}")
    if cut_cols:
        parts.append(
            f"{cut_cols} column(s) of {', '.join(n for n, c in keep.items() if c is not None)}"
        )
    note = f"schema pruned to {len(keep)} of {len(schema.tables)} tables; left out: " + "; ".join(
        parts
    )
    return Pruned(text(keep), note, [t.name for t in schema.tables if t.name in keep])


@dataclass
class Pruner:
    """Prunes one database's schema for each question that needs it; the value index is read
    from `db` the first time it is needed (most databases never need it)."""

    schema: Schema
    db: ReadOnlyDb | None = None
    _index: ValueIndex | None = None

    @property
    def index(self) -> ValueIndex:
        if self._index is None:
            self._index = ValueIndex.build(self.db, self.schema) if self.db else ValueIndex()
        return self._index

    def prune(
        self,
        question: str,
        style: SchemaStyle,
        fits: Callable[[str], bool],
        required: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> Pruned | None:
        return prune(self.schema, rank(self.schema, question, self.index), style, fits, required)

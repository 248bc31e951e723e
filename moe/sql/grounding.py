"""Whether a query's text literals are values its database holds, for the vote over candidates
(moe/sql/consistency.py `choose(grounded=)`).

A small model filters on the wrong column (`genre_id = 'Rock'`, `billingcountry = 'Paris'`)
or miscopies a value (`name = 'Dami'` for Dapelo); such a query runs, returns nothing, and its
samples agree with each other. A comparison of a column with a text literal (`=`, `!=`, `IN`)
is *ungrounded* when the column holds numbers and the literal is not one, or when the column's
values were read whole by the value index (moe/sql/pruning.py `ValueIndex`) and the literal,
compared as the index compares (`phrase`: lower case, words), is not among them; and, given
the question, when a text column's literal is not in the question's words (the model wrote a
real doctor's name, but not the one asked about). A column the index did not read, one the
query does not resolve, and every other literal say nothing. Unlike preferring results with
rows, a query on the question's own value that returns nothing (a doctor without
appointments) stays grounded.

The test gives a level, not a yes or no: UNHELD (a value the database does not hold),
UNNAMED (held, but a text value the question does not name, in any of the forms
moe/sql/forms.py matches: "French" for 'France'), HELD (held, and no text value compared
with the question) and NAMED (held, and the question names every text value).
moe/sql/consistency.py `choose` takes an UNHELD candidate's vote, and an UNNAMED one's only
when another candidate NAMES the question's values: a held value is never outvoted through
the question's words by a candidate that names no value.
"""

from __future__ import annotations

from collections.abc import Callable

from moe.sql.databases import Database
from moe.sql.forms import named_in
from moe.sql.pruners import pruner_for
from moe.sql.pruning import SAMPLE_ROWS, VALUES_PER_COLUMN, ValueIndex, phrase
from moe.sql.schema import Column, Schema

_DIALECTS = {"sqlite": "sqlite", "postgresql": "postgres"}
UNHELD, UNNAMED, HELD, NAMED = 0, 1, 2, 3  # a query's grounding (the module says which is which)


def grounding(
    schema: Schema, index: ValueIndex, read_limit: int = VALUES_PER_COLUMN
) -> Callable[[str, str], int]:
    """A test of one query (and the question it answers, with its evidence; "" for none) on
    the database of `schema`, whose value index read at most `read_limit` values a column:
    UNHELD, UNNAMED, HELD or NAMED (see the module)."""
    tables = {t.name.lower(): t for t in schema.tables}
    counted = {t.name for t in schema.tables if not t.estimated and t.rows < SAMPLE_ROWS}
    whole = {  # a column read only in part proves nothing; the index drops some values it
        # reads (too short once in words), so a read near the limit counts as cut
        (t.lower(), c.lower()): set(v)
        for (t, c), v in index.values.items()
        if len(v) < 0.9 * min(read_limit, VALUES_PER_COLUMN) and t in counted
    }
    read_text = {(t.lower(), c.lower()) for t, c in index.values}  # text columns the index read
    dialect = _DIALECTS.get(schema.dialect, "sqlite")

    def grounded(sql: str, question: str = "") -> int:
        import sqlglot
        from sqlglot import exp

        try:
            tree = sqlglot.parse_one(sql, read=dialect)
        except Exception:  # noqa: BLE001 (what does not parse says nothing here)
            return HELD
        scopes: dict[int, dict[str, str]] = {}  # a SELECT's own tables, by alias

        def scope(node: exp.Expression) -> dict[str, str]:
            sel = node.find_ancestor(exp.Select)
            if id(sel) not in scopes:
                own = [t for t in (sel or tree).find_all(exp.Table)
                       if t.find_ancestor(exp.Select) is sel]  # fmt: skip
                scopes[id(sel)] = {t.alias_or_name.lower(): t.name.lower() for t in own}
            return scopes[id(sel)]

        def column(col: exp.Column) -> tuple[str, Column] | None:
            names = scope(col)
            read = [tables[n] for n in set(names.values()) if n in tables]
            name, owner = col.name.lower(), names.get(col.table.lower(), "")
            if col.table and owner not in tables:
                return None
            owners = [tables[owner]] if col.table else read
            hits = [(t.name, c) for t in owners for c in t.columns if c.name.lower() == name]
            return hits[0] if len(hits) == 1 else None

        named = unnamed = 0  # text values the question names, and does not
        for node in tree.find_all(exp.EQ, exp.NEQ, exp.In):
            if isinstance(node, exp.In):
                col, lits = node.this, node.expressions
            elif isinstance(node.left, exp.Column):
                col, lits = node.left, [node.right]
            else:
                col, lits = node.right, [node.left]
            if not isinstance(col, exp.Column):
                continue
            texts = [x.this for x in lits if isinstance(x, exp.Literal) and x.is_string]
            found = column(col) if texts else None
            if found is None:
                continue
            table, c = found
            key = (table.lower(), c.name.lower())
            values, asked = whole.get(key), key in read_text and question
            for text in texts:
                if c.numeric and not _number(text):
                    return UNHELD
                if not 2 <= len(text) <= 60:  # the index reads values of 2 to 60 characters
                    continue
                said = phrase(text)
                if len(said.strip()) < 2:  # not words the index or a question compares
                    continue
                if values is not None and said.strip() not in values:
                    return UNHELD
                if asked:
                    named, unnamed = (named + 1, unnamed) if named_in(text, question) else (
                        named, unnamed + 1)  # fmt: skip
        return UNNAMED if unnamed else NAMED if named else HELD

    return grounded


def for_database(db: Database, schema: Schema | None = None) -> Callable[[str, str], int]:
    """`grounding` for an open database (a sqlite file or a server; `schema`: its schema when
    already read), its value index read as schema pruning reads it (moe/sql/pruners.py)."""
    schema = schema or db.schema()
    return grounding(schema, pruner_for(schema, db).index, getattr(db, "row_limit", 10**9))


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

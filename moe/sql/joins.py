"""Joins held to the schema's foreign keys, for the identifier constraint
(moe/sql/constrain.py): where the schema links the table a JOIN names to a table the query
part read before it, the JOIN names such a table, and its ON condition pairs a column of one
with the column of the other that a foreign key links it to (`JOIN album AS T2 ON T1.id =
T2.artist_id`, not `T1.id = T2.id`). SmolLM2 joined Chinook's invoice to itself on
`T1.id = T2.invoicedate` and album to artist on both ids. Where no foreign key links them
(a Spider database that declares none), joins stay free.

`Links` maps a table (its key: unquoted, lower case) to `(its column, other table, other's
column, whether the other is the parent)` for each foreign key either way; a key to the table
itself links it to itself (employee.reports_to -> employee.id).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

Links = dict[str, list[tuple[str, str, str, bool]]]
_NAME = r'"[^"]+"|\w+'
# The FROM or JOIN of a query part and the table it names.
_READ = re.compile(rf"\b(?:FROM|JOIN)\s+({_NAME})", re.IGNORECASE)
# The last JOIN, its table, and its ON condition so far (no parenthesis in it: a subquery or
# an expression there leaves the condition free; nor a clause after it).
_CLAUSE = r"\b(?:JOIN|WHERE|GROUP|ORDER|HAVING|LIMIT|UNION|INTERSECT|EXCEPT)\b"
_ON_AT = re.compile(
    rf"\bJOIN\s+({_NAME})(?:\s+AS)?(?:\s+(?!ON\b)[A-Za-z_]\w*)?\s+ON\b((?:(?!{_CLAUSE})[^()])*)$",
    re.IGNORECASE,
)
# The condition's first operand, complete, and its `=`: the second operand comes next.
_FIRST = re.compile(rf"^\s*({_NAME})\.({_NAME})\s*=\s*$")


def key(name: str) -> str:
    """A name as SQL compares it: unquoted and lower case."""
    return name.strip('"').replace('""', '"').lower()


def links_of(foreign_keys: Iterable[tuple[str, str, str, str]], tables: set[str]) -> Links:
    """Each table of `tables` (keys) with the foreign keys that link it to another of them,
    from a schema's `(child, column, parent, column)` list."""
    out: Links = {}
    for child, ccol, parent, pcol in foreign_keys:
        c, p = key(child), key(parent)
        if c in tables and p in tables:
            out.setdefault(c, []).append((key(ccol), p, key(pcol), True))
            out.setdefault(p, []).append((key(pcol), c, key(ccol), False))
    return out


def read_in(part: str, known: Iterable[str]) -> list[str]:
    """The tables (keys) that FROM and JOIN name in the query `part`, of those `known`."""
    have = set(known)
    return [k for m in _READ.finditer(part) if (k := key(m.group(1))) in have]


def joinable(part: str, tables: list[str], links: Links) -> list[str]:
    """Of `tables` (SQL's forms), those the JOIN at the end of the query `part` may name: a
    table a foreign key links to one the part read before, another child of a parent one of
    them has (Spider's city and countrylanguage, both of country), or a table no key names
    (Spider's flight_2 declares none for airlines: its joins cannot be checked); all of them
    where the tables read have no key. A table joins itself only through a key of its own."""
    read = read_in(part, links)
    near = {other for t in read for _, other, _, _ in links[t]}
    if not near:
        return tables
    parents = {other for t in read for _, other, _, up in links[t] if up}
    near |= {c for p in parents for _, c, _, up in links[p] if not up and c not in read}
    return [t for t in tables if key(t) in near or key(t) not in links]


def on_columns(
    before: str, table: str, links: Links, table_of: Callable[[str], str | None]
) -> set[str] | None:
    """The columns (keys) of `table` that may follow the qualifier written at the end of
    `before` (the query part up to it) in a JOIN's ON condition: a column of a foreign key
    between the joined table and one read before it, and after `T1.col =` the column that
    key pairs with it. None (free) outside an ON condition, past its first comparison, or
    where no foreign key links the tables."""
    m = _ON_AT.search(before)
    if not m:
        return None
    joined = key(m.group(1))
    earlier = set(read_in(before[: m.start()], links))
    pairs = [(jc, t, c) for jc, t, c, _ in links.get(joined, []) if t in earlier]
    cond = m.group(2)
    if not cond.strip():
        got = {jc for jc, _, _ in pairs if table == joined}
        got |= {c for _, t, c in pairs if t == table}
        return got or None
    first = _FIRST.match(cond)
    if not first:
        return None
    side, col = table_of(key(first.group(1))), key(first.group(2))
    got = {c for jc, t, c in pairs if side == joined and col == jc and t == table}
    got |= {jc for jc, t, c in pairs if side == t and col == c and table == joined}
    return got or None

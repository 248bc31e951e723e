"""A held query's names written as the schema writes them.

The identifier constraint (moe/sql/constrain.py) compares names as SQL does, without regard
to case, so a small model may write `AiRpOrTnAME` for `AirportName` or `MpG` for `MPG`: the
database runs it (an unquoted name's case means nothing to SQLite, PostgreSQL or DuckDB) but a
user reads odd SQL. `in_schema_spelling` gives each unquoted word that names one of the
schema's tables or columns the schema's own spelling, and changes nothing else: string
literals, quoted names, numbers, comments and the rest of the text stay byte for byte, and a
word followed by `(` (a function: `COUNT(`) keeps its case. A word that two of the schema's
names spell differently (`Name` in one table, `name` in another) is left as written, and so
is a name the schema must quote (`"Home Town"`): the constraint offers it quoted already.

A hand-written scanner, not sqlglot's tokenizer: that one reads keywords by dialect and
returns tokens, and the text must come back whole with only the names' case changed.
"""

from __future__ import annotations

import re

from moe.sql.constrain import Names

# Left to right, the first alternative that matches wins: a literal or a quoted name is one
# piece, so a word inside it is never looked at; a number is one piece (`1e5` has no `e5`).
_PIECE = re.compile(
    r"""'(?:[^']|'')*'?"""  # a string literal ('' escapes a quote; may be cut off)
    r'|"(?:[^"]|"")*"?'  # a quoted name
    r"|`[^`]*`?|\[[^\]]*\]?"  # MySQL's and SQL Server's quoted names
    r"|--[^\n]*|/\*.*?(?:\*/|$)"  # comments
    r"|\d[\w.]*"  # a number
    r"|(?P<word>[A-Za-z_][A-Za-z0-9_$]*)(?P<call>\s*\()?",
    re.DOTALL,
)


def spellings(names: Names) -> dict[str, str]:
    """Each unquoted table and column name of `names` by its lower case, where the schema
    spells it one way only."""
    seen: dict[str, set[str]] = {}
    for name in [*names.tables, *(c for cols in names.columns.values() for c in cols)]:
        if not name.startswith('"'):
            seen.setdefault(name.lower(), set()).add(name)
    return {low: next(iter(forms)) for low, forms in seen.items() if len(forms) == 1}


def in_schema_spelling(sql: str, names: Names) -> str:
    """`sql` with each unquoted word that names a table or column of `names` spelled as the
    schema spells it (module docstring: what is and is not changed)."""
    spelled = spellings(names)

    def one(m: re.Match[str]) -> str:
        word = m.group("word")
        if word is None or m.group("call"):
            return m.group(0)
        return spelled.get(word.lower(), word)

    return _PIECE.sub(one, sql)

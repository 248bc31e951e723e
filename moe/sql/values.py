"""The cell values a question names, shown to the model beside their columns (as BRIDGE and
CodeS do): `-- values: customer.country = 'France'; genre.name = 'Rock'`. A small model
otherwise guesses a literal's spelling or its column ('rock' for 'Rock', a city written into
a country column).

The values come from schema pruning's value index (moe/sql/pruning.py `ValueIndex`: at most
2,000 distinct text values of each non-key text column), as the database writes them. A value
is named when its words stand together in the question (case aside: `phrase`), or, for a
country, when the question uses another of its forms ("French" for 'France': moe/sql/forms.py
`FORMS`). A one-word value must not be a stop word or a number (`ValueIndex.hits`).
Longer values come first (they say more), then those of a column whose table's or own name
the question uses ("singers": `singer.country` before `customer.country`), at most `PER_COLUMN` a column and `limit` in all; a
value inside a longer one already shown ('York' in 'New York') is left out; one value held by
two columns is shown with each (the question's other words tell the model which).

Prepare computes the line once for each pair (data.sql_question_values) and stores it with the
pair, so training, evaluation and `ask` give the model the same text.
"""

from __future__ import annotations

from moe.sql.forms import FORMS
from moe.sql.pruning import ValueIndex, phrase, words

PER_COLUMN = 3


def _literal(v: str) -> str:
    return "'" + v.replace("'", "''") + "'"


def named_values(
    index: ValueIndex, question: str, limit: int, tables: set[str] | None = None
) -> list[tuple[str, str, str]]:
    """The values `question` names, as (table, column, value as the database writes it),
    longest first, at most `limit`; with `tables` (a pruned schema's), only those of its
    tables, out of the `limit` chosen (so the line only shrinks when the schema is cut)."""
    if limit <= 0:
        return []
    said = phrase(question)
    found = {k: list(v) for k, v in index.hits(question).items()}
    for country in {f for form in FORMS for f in FORMS[form] if f" {form} " in said}:
        for key in index.holding(country):
            if country not in found.setdefault(key, []):
                found[key].append(country)
    cands = [
        (t, c, p)
        for (t, c), vals in found.items()
        for p in sorted(set(vals), key=lambda p: (-len(p), p))[:PER_COLUMN]
        if len(index.raw.get((t, c), {}).get(p, "").splitlines()) <= 1  # the line stays one
    ]
    asked = words(question)  # a column whose table or name the question uses goes first
    cands.sort(key=lambda x: (-len(x[2]), not asked & (words(x[0]) | words(x[1])), x[0], x[1]))
    out: list[tuple[str, str, str]] = []
    for t, c, p in cands:
        if any(q != p and f" {p} " in f" {q} " for _, _, q in out):
            continue
        out.append((t, c, p))
        if len(out) == limit:
            break
    return [
        (t, c, index.raw.get((t, c), {}).get(p, p))
        for t, c, p in out
        if tables is None or t in tables
    ]


def values_line(
    index: ValueIndex, question: str, limit: int, tables: set[str] | None = None
) -> str:
    """The text of the prompt's values line for `question` ('' when it names none):
    `customer.country = 'France'; genre.name = 'Rock'` (`named_values`)."""
    got = named_values(index, question, limit, tables)
    return "; ".join(f"{t}.{c} = {_literal(v)}" for t, c, v in got)

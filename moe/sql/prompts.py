"""The text of a finetuning example: what the model reads before it writes SQL (the prompt)
and what it is taught to write (the response). Used alike by finetuning, evaluation and
serving, so that the model is always asked the same way; it needs nothing but the pair."""

from __future__ import annotations

from moe.sql.records import SqlPair


def prompt_text(pair: SqlPair) -> str:
    """What the model sees before it writes SQL (the schema keeps it grounded; the cell
    values the question names, beside their columns, and BIRD's evidence, when a pair has
    them, come before the question)."""
    vals = f"-- values: {pair.values}\n" if pair.values else ""
    ev = f"-- evidence: {pair.evidence}\n" if pair.evidence else ""
    return f"-- schema: {pair.schema}\n{vals}{ev}-- question: {pair.question}\n"


def response_text(pair: SqlPair) -> str:
    """What the model is taught to write: the pair's SQL on one line."""
    return f"{pair.sql}\n"

"""Identifiers held to the schema while decoding (after PICARD's incremental checks, at the
identifiers alone): right after `FROM` or `JOIN` the next name is one of the prompt's (pruned)
schema's tables, and right after `alias.` one of that table's columns; a name that must be
quoted (spaces, a reserved word) is offered quoted only, as the database's dialect writes it
(moe/sql/schema.py `ident`). Keywords, literals, expressions, subqueries and unqualified
columns stay free.

At each step of the batched decoder (`MoETransformer.generate_batch`'s `adjust`), a row in an
identifier position keeps only the tokens that continue an allowed name: a vocabulary piece
equal to the next characters of a name (after a space, when the keyword was just written).
The allowed set is a handful of names' prefixes, so each step costs a dictionary lookup per
prefix, not a pass over the vocabulary; a complete name may go on to a longer one or end (a
token that starts with a space, punctuation or the end token), and a position no name
continues (a quoted name where the schema has none) is left free.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from moe.sql.schema import Schema, ident

# The table position: FROM or JOIN, whitespace, then the name being written (maybe quoted).
_TABLE_AT = re.compile(r'\b(?:FROM|JOIN)(\s+)("[^"]*|\w*)$', re.IGNORECASE)
_TABLE_NEXT = re.compile(r"\b(?:FROM|JOIN)$", re.IGNORECASE)  # the keyword, nothing after it
# The column position: a qualifier, a dot, then the column name being written.
_COLUMN_AT = re.compile(r'(?<![\w."])("[^"]+"|[A-Za-z_]\w*)\.("[^"]*|\w*)$')
# `FROM t AS a`, `JOIN t a`: which table an alias stands for (a lookahead, so that `FROM a
# JOIN b AS T2` binds T2 although `FROM a` was read first).
_ALIAS = re.compile(
    r'\b(?:FROM|JOIN)\s+(?=("[^"]+"|\w+)(?:\s+AS)?\s+([A-Za-z_]\w*))', re.IGNORECASE
)
# Where a query part starts: an alias is bound within its part (T1 again after INTERSECT).
_PART = re.compile(r"\b(?:UNION|INTERSECT|EXCEPT)\b|\(\s*SELECT\b", re.IGNORECASE)
# FROM inside these functions' parentheses is an argument, not a table (PostgreSQL).
_FROM_FUNCTIONS = {"extract", "substring", "trim", "overlay", "position"}
_NOT_ALIAS = {
    "where", "join", "inner", "left", "right", "full", "outer", "cross", "on", "group",
    "order", "limit", "having", "union", "intersect", "except", "as", "natural", "using",
}  # fmt: skip


@dataclass
class Names:
    """What a question's schema lets it name: its tables, and each table's columns, in the
    forms SQL writes them (`ident`); keys are lower case, as SQL compares unquoted names."""

    tables: list[str]
    columns: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, schema: Schema, shown: str = "") -> Names:
        """`schema`'s tables that the prompt's schema text `shown` lists (pruning keeps some;
        "" = all of them), with their columns."""
        listed = _listed_tables(shown)
        tables = [t for t in schema.tables if not listed or t.name.lower() in listed]
        return cls(
            [ident(t.name) for t in tables],
            {_key(t.name): [ident(c.name) for c in t.columns] for t in tables},
        )


def _key(name: str) -> str:
    """A name as SQL compares it: unquoted and lower case."""
    return name.strip('"').replace('""', '"').lower()


def _listed_tables(shown: str) -> set[str]:
    """The table names a serialised schema (`table(col type, ...); ...`) lists."""
    body = re.sub(r"^\[\w+\] ", "", shown)  # the dialect header (moe/sql/schema.py)
    return {part.split("(", 1)[0].strip().lower() for part in body.split("; ") if "(" in part}


class Pieces:
    """The text of each vocabulary token, indexed by its lower-case text, and which tokens end
    an identifier (their text starts with anything but a letter, digit or underscore, or is
    empty: the end token); built once per tokenizer, so that a decoder step looks pieces up
    and never scans the vocabulary."""

    def __init__(self, tok: Any) -> None:
        self.by_text: dict[str, list[int]] = defaultdict(list)
        ending = []
        for i in range(tok.get_vocab_size()):
            text = tok.decode([i])
            if text:
                self.by_text[text.lower()].append(i)
            ending.append(not text or not (text[0].isalnum() or text[0] == "_"))
        self.ending_V = torch.tensor(ending)

    def continuing(self, rest: str, lead: bool) -> set[int]:
        """Tokens whose text is a non-empty prefix of `rest`, after one space when `lead`."""
        out: set[int] = set()
        pre = " " if lead else ""
        for j in range(1, len(rest) + 1):
            out.update(self.by_text.get(pre + rest[:j], ()))
        if lead:
            out.update(self.by_text.get(" ", ()))
        return out


class IdentifierConstraint:
    """The `adjust` of a batched decode: row b names only what `names[b]` allows."""

    def __init__(
        self, tok: Any, pieces: Pieces, names: list[Names], written: list[str] | None = None
    ) -> None:
        """`written`: what each row's answer already holds in its prompt ("" each: nothing)."""
        self.tok, self.pieces, self.names = tok, pieces, names
        self.written = written or [""] * len(names)
        self.steps = 0  # decoder steps at which some row was held to a name (for the report)

    def __call__(self, logits_BV: torch.Tensor, generated: list[list[int]]) -> None:
        held = False
        for b, tokens in enumerate(generated):
            text = self.written[b] + self.tok.decode(tokens)
            allowed, ending = self.allowed(text, self.names[b])
            if not allowed and not ending:
                continue
            keep_V = torch.zeros(logits_BV.shape[1], dtype=torch.bool)
            keep_V[sorted(allowed)] = True
            if ending:  # a complete name may also end here (rows past the tokenizer's: no)
                n = min(len(keep_V), len(self.pieces.ending_V))
                keep_V[:n] |= self.pieces.ending_V[:n]
            logits_BV[b] = logits_BV[b].masked_fill(~keep_V.to(logits_BV.device), float("-inf"))
            held = True
        self.steps += held

    def allowed(self, text: str, names: Names) -> tuple[set[int], bool]:
        """The tokens that may come next after `text` (none: any), and whether any token that
        ends an identifier may too (the name written so far is complete)."""
        literal, quoted = _open_quotes(text)
        if literal:  # inside a string: nothing here is a name
            return set(), False
        if _TABLE_NEXT.search(text) and not quoted and not _function_from(text):
            ids, ending = self._continuing("", names.tables, lead=True)
            return ids | self._subquery(True), ending
        m = _TABLE_AT.search(text)
        if m and not _function_from(text[: m.start(1)]):
            partial = m.group(2)
            ids, ending = self._continuing(partial, names.tables, lead=False)
            return ids | (set() if partial or not ids else self._subquery(False)), ending
        m = _COLUMN_AT.search(text)
        if m:
            table = _table_of(_key(m.group(1)), text, names)
            if table is not None:
                return self._continuing(m.group(2), names.columns[table], lead=False)
        return set(), False

    def _continuing(self, partial: str, forms: list[str], lead: bool) -> tuple[set[int], bool]:
        low = partial.lower()
        rests = [f.lower()[len(low) :] for f in forms if f.lower().startswith(low)]
        out: set[int] = set()
        for rest in rests:
            out |= self.pieces.continuing(rest, lead)
        return out, "" in rests

    def _subquery(self, lead: bool) -> set[int]:
        return self.pieces.continuing("(", lead)


def _table_of(qualifier: str, text: str, names: Names) -> str | None:
    """The table a qualifier names: the alias the query part being written gave it (bound
    once; bound to two tables there it is ambiguous: None), or the table itself."""
    starts = [m.start() for m in _PART.finditer(text)]
    part = text[starts[-1] :] if starts else text
    bound = {
        _key(m.group(1))
        for m in _ALIAS.finditer(part)
        if m.group(2).lower() == qualifier and qualifier not in _NOT_ALIAS
    }
    if len(bound) == 1:
        table = bound.pop()
        return table if table in names.columns else None
    if bound:
        return None
    return qualifier if qualifier in names.columns else None


def _open_quotes(text: str) -> tuple[bool, bool]:
    """Whether `text` ends inside a string literal, and inside a quoted name (SQL doubles a
    quote to escape it, which keeps the counts even)."""
    single = double = False
    for ch in text:
        if ch == "'" and not double:
            single = not single
        elif ch == '"' and not single:
            double = not double
    return single, double


def _function_from(text: str) -> bool:
    """Whether the FROM that `text` ends with is an argument (`EXTRACT(YEAR FROM d)`,
    `SUBSTRING(s FROM 2)`, `TRIM(x FROM s)`) or the comparison `IS DISTINCT FROM`."""
    if re.search(r"\bDISTINCT\s+FROM$", text.rstrip(), re.IGNORECASE):
        return True
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        if text[i] == ")":
            depth += 1
        elif text[i] == "(":
            if depth == 0:
                word = re.search(r"(\w+)\s*$", text[:i])
                return bool(word) and word.group(1).lower() in _FROM_FUNCTIONS
            depth -= 1
    return False

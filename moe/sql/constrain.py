"""Identifiers held to the schema while decoding (after PICARD's incremental checks, at the
identifiers alone): right after `FROM` or `JOIN` the next name is one of the prompt's (pruned)
schema's tables, and right after `alias.` one of that table's columns; a name that must be
quoted (spaces, a reserved word) is offered quoted only, as the database's dialect writes it
(moe/sql/schema.py `ident`). A bare word where an operand starts (after SELECT, DISTINCT,
WHERE, AND, OR, ON, BY, HAVING, NOT, a parenthesis, a comma or an operator) is one of the
schema's columns or tables, an alias the query gave, or an SQL keyword or function; in the
SELECT list, before FROM binds them, an alias to come (T1..T9) too, and after `T2.` a column
of any of the tables (`Pieces(bare=False)`: these words stay free). Once complete, a table or
a table's alias goes on to its dot, a function to its parenthesis, and a column or SQL's word
to anything but a dot. Literals, numbers and quoted names stay free.

SQL names the columns before the tables, so the table after FROM or JOIN is held to what the
query part named before it (`_ahead`): the k-th table has the columns written as `Tk.col`
(Spider's convention binds Tk to it), and the SELECT list's bare columns that no table named
so far has. A JOIN follows the schema's foreign keys where it declares any (moe/sql/joins.py):
the table is linked to one read before, and the ON condition pairs the key's columns. Only the
functions the database's engine has are offered (`Schema.functions`).

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
from enum import IntEnum
from typing import Any

import torch

from moe.sql import scopes
from moe.sql.joins import Links, joinable, links_of, on_columns
from moe.sql.joins import key as _key  # a name as SQL compares it: unquoted, lower case
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
# FROM inside these functions' parentheses is an argument, not a table (PostgreSQL).
_FROM_FUNCTIONS = {"extract", "substring", "trim", "overlay", "position"}
# An operand's start: a keyword or a punctuation that comes before one, then the bare word
# being written (if any).
_OPERAND_AT = re.compile(
    r"(?:\b(SELECT|DISTINCT|WHERE|AND|OR|ON|BY|HAVING|NOT)\b|[(,=<>+\-/])(\s*)([A-Za-z_]\w*)?$",
    re.IGNORECASE,
)
# Keywords a trigger may be the start of, when nothing follows it yet (OR + DER: ORDER).
_LONGER = ("order", "notnull", "only")
_SELECT_ALIAS = re.compile(r"\bAS\s+([A-Za-z_]\w*)", re.IGNORECASE)
# An output's alias without AS: `count(*) n,` or `name n FROM`.
_BARE_ALIAS = re.compile(r'[\w)"]\s+([A-Za-z_]\w*)\s*(?=,|\bFROM\b)', re.IGNORECASE)
_COMMA_ALIAS = re.compile(r',\s*("[^"]+"|\w+)(?:\s+AS)?\s+([A-Za-z_]\w*)', re.IGNORECASE)
_CTE = re.compile(r"(?:\bWITH(?:\s+RECURSIVE)?|,)\s*([A-Za-z_]\w*)\s+AS\s*\(", re.IGNORECASE)
# What a bare word at an operand's start may be besides a name: the functions of sqlite and
# PostgreSQL a query is likely to call (followed by their parenthesis, unless a column of the
# query has the name: Spider's `date`, `rank`, `age`), SQL's words that may begin an operand
# (`WHERE is` never runs; SmolLM2 wrote it), those that come only after NOT (`NOT IN`, `IS
# NOT NULL`), and the units EXTRACT reads, words only right after `EXTRACT(` (neither sqlite
# nor PostgreSQL has `year(d)`).
FUNCTIONS = frozenset(
    """count sum avg min max total group_concat string_agg abs round length char_length lower
    upper trim ltrim rtrim substr substring replace instr position coalesce ifnull nullif iif
    strftime date datetime julianday time extract date_part date_trunc to_char age now concat
    printf typeof random row_number rank dense_rank lag lead floor ceil ceiling greatest least
    power mod sqrt sign trunc cast exists""".split()
)
STARTERS = frozenset(
    """select distinct all any some exists not null true false case cast interval current_date
    current_time current_timestamp""".split()
)
AFTER_NOT = frozenset("in like between null exists ilike glob regexp similar distinct".split())
UNITS = frozenset("year month day hour minute second epoch".split())
SQL_WORDS = FUNCTIONS | STARTERS | AFTER_NOT | UNITS  # every SQL word an operand may start with
# Calls that are the dialect's syntax, not functions its catalogue lists (PostgreSQL's
# COALESCE, GREATEST, TRIM(... FROM ...)): kept when the engine's own list decides the rest.
_SYNTAX = {
    "sqlite": {"cast", "exists"},
    "postgresql": {"cast", "exists", "coalesce", "nullif", "greatest", "least", "trim",
                   "extract", "position", "overlay", "substring"},
}  # fmt: skip
_UNIT_AT = re.compile(r"\bEXTRACT\s*\(\s*\w*$", re.IGNORECASE)


class End(IntEnum):
    """Which tokens may end a complete name: none, any (a space, punctuation, the end
    token), or any but a dot (a column or SQL's word: `is.` names nothing)."""

    NONE = 0
    ANY = 1
    NO_DOT = 2


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
    functions: frozenset[str] = FUNCTIONS  # those of FUNCTIONS the database's engine has
    links: Links = field(default_factory=dict)  # the foreign keys (moe/sql/joins.py)

    @classmethod
    def of(cls, schema: Schema, shown: str = "") -> Names:
        """`schema`'s tables that the prompt's schema text `shown` lists (pruning keeps some;
        "" = all of them), with their columns, and the functions its engine has (sqlite has
        no `now`, PostgreSQL no `julianday`; all of FUNCTIONS when the schema did not read
        its engine's list)."""
        listed = _listed_tables(shown)
        tables = [t for t in schema.tables if not listed or t.name.lower() in listed]
        known = schema.functions | _SYNTAX.get(schema.dialect, set())
        return cls(
            [ident(t.name) for t in tables],
            {_key(t.name): [ident(c.name) for c in t.columns] for t in tables},
            FUNCTIONS & known if schema.functions else FUNCTIONS,
            links_of(schema.foreign_keys, {_key(t.name) for t in tables}),
        )


def _listed_tables(shown: str) -> set[str]:
    """The table names a serialised schema (`table(col type, ...); ...`) lists."""
    body = re.sub(r"^\[\w+\] ", "", shown)  # the dialect header (moe/sql/schema.py)
    return {part.split("(", 1)[0].strip().lower() for part in body.split("; ") if "(" in part}


class Pieces:
    """The text of each vocabulary token, indexed by its lower-case text, and which tokens end
    an identifier (their text starts with anything but a letter, digit or underscore, or is
    empty: the end token); built once per tokenizer, so that a decoder step looks pieces up
    and never scans the vocabulary."""

    def __init__(self, tok: Any, bare: bool = True) -> None:
        """`bare`: hold the bare words at an operand's start too (else only the names after
        FROM, JOIN and `alias.`)."""
        self.bare = bare
        self.by_text: dict[str, list[int]] = defaultdict(list)
        ending, literal, dot = [], [], []
        for i in range(tok.get_vocab_size()):
            text = tok.decode([i])
            if text:
                self.by_text[text.lower()].append(i)
            ending.append(not text or not (text[0].isalnum() or text[0] == "_"))
            dot.append(text.startswith("."))
            # no word starts here: a number, a quote, a parenthesis, an operator or spaces
            first = text.lstrip(" ")[:1]
            literal.append(bool(text) and not (first.isalpha() or first == "_"))
        self.ending_V = torch.tensor(ending)
        self.word_end_V = self.ending_V & ~torch.tensor(dot)  # an ending, but not a dot
        self.literal = {i for i, x in enumerate(literal) if x}
        self.dot = {i for i, x in enumerate(dot) if x}  # `alias.`
        self.paren = {  # `count(`, `EXISTS (`
            i for t, ids in self.by_text.items() if t.startswith(("(", " (")) for i in ids
        }

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
                end_V = self.pieces.word_end_V if ending == End.NO_DOT else self.pieces.ending_V
                n = min(len(keep_V), len(end_V))
                keep_V[:n] |= end_V[:n]
            logits_BV[b] = logits_BV[b].masked_fill(~keep_V.to(logits_BV.device), float("-inf"))
            held = True
        self.steps += held

    def allowed(self, text: str, names: Names) -> tuple[set[int], End]:
        """The tokens that may come next after `text` (none: any), and which tokens that end
        an identifier may too, where the name written so far is complete."""
        literal, quoted = _open_quotes(text)
        if literal:  # inside a string: nothing here is a name
            return set(), End.NONE
        m = _TABLE_NEXT.search(text)
        if m and not quoted and not _function_from(text):
            tables = self._tables(text[: m.start()], names, m.group()[0] in "jJ")
            ids, ending = self._continuing("", tables, lead=True)
            return ids | self._subquery(True), ending
        m = _TABLE_AT.search(text)
        if m and not _function_from(text[: m.start(1)]):
            partial = m.group(2)
            tables = self._tables(text[: m.start()], names, m.group()[0] in "jJ")
            ids, ending = self._continuing(partial, tables, lead=False)
            return ids | (set() if partial or not ids else self._subquery(False)), ending
        m = _COLUMN_AT.search(text)
        if m:
            table = _table_of(_key(m.group(1)), text, names)
            if table is not None:
                cols = [*names.columns[table], "*"]
                if self.pieces.bare:  # in a JOIN's ON condition: the foreign key's columns
                    before = scopes.part(text[: m.start()])
                    on = on_columns(before, table, names.links, lambda q: _table_of(q, text, names))
                    cols = [c for c in cols if _key(c) in on] if on else cols
                return self._continuing(m.group(2), cols, lead=False)
            if self.pieces.bare and not _TABLE_IN.search(scopes.part(text)):
                # `SELECT T2.`: the alias is bound later, by FROM; a column of some table
                return self._continuing(m.group(2), [*_columns(names), "*"], lead=False)
            return set(), End.NONE
        if self.pieces.bare and not quoted:
            return self._operand(text, names)
        return set(), End.NONE

    def _tables(self, prior: str, names: Names, join: bool) -> list[str]:
        """The tables the FROM or JOIN after `prior` may name: with the bare words held, those
        that let what the query named before them run (`_ahead`), and after JOIN those a
        foreign key links to a table read before, where the schema links any. Where the two
        disagree the keys win: the look-ahead's table joined against the keys is a table
        joined to itself on unrelated columns (`invoice AS T1 JOIN invoice AS T2 ON T1.id =
        T2.invoicedate`), which runs and answers wrong; a linked table fails instead, and
        execution-guided decoding drops it."""
        if not self.pieces.bare:
            return names.tables
        tables = _ahead(prior, names)
        if not join or _UNKEYED.search(prior):  # CROSS and NATURAL JOIN take no key
            return tables
        keyed = joinable(scopes.part(prior), names.tables, names.links)
        return [t for t in tables if t in keyed] or keyed

    def _operand(self, text: str, names: Names) -> tuple[set[int], End]:
        """A bare word where an operand starts: a column or table of the schema, an alias of
        the query, or an SQL word; or no word at all (a number, a string, a parenthesis). In
        the SELECT list, before FROM binds the query's aliases, an alias to come (T1) too.
        Once complete, a table or a table's alias goes on to its dot, a function to its
        parenthesis, and a column or SQL's word to anything but a dot."""
        m = _OPERAND_AT.search(text)
        if not m:
            return set(), End.NONE
        if _TABLE_IN.search(scopes.part(text)):  # the columns of the tables the query reads
            read = _tables_read(text, names)
            columns = _columns(names, read)
            qualifiers = {t for t in names.tables if not read or _key(t) in read}
        else:
            columns = _columns(names)
            qualifiers = set(names.tables) | set(ALIASES_TO_COME) | _initials(names)
        tables, outputs, ctes = _aliases(text)
        qualifiers = {q.lower() for q in qualifiers | tables | ctes}
        plain = {c.lower() for c in columns} | {a.lower() for a in outputs | ctes}
        keyword, space, partial = (m.group(1) or "").lower(), m.group(2), m.group(3) or ""
        plain |= STARTERS | (AFTER_NOT if keyword == "not" else set())
        if _UNIT_AT.search(text):
            plain |= UNITS
        words = list(plain | qualifiers | names.functions)
        if partial:
            ids, complete = self._continuing(partial, words, lead=False)
            word = partial.lower()
            if not complete:
                return ids, End.NONE
            if word in names.functions:
                ids |= self.pieces.paren
            if word in plain:
                return ids, End.ANY if word in qualifiers else End.NO_DOT
            return ids | (self.pieces.dot if word in qualifiers else set()), End.NONE
        ids: set[int] = set()
        if space or not keyword:  # `WHERE ` or `(`: the word may start right here
            ids |= self._continuing("", words, lead=False)[0]
        if not space:  # `WHERE`, `=`: the word may come after a space
            ids |= self._continuing("", words, lead=True)[0]
        if keyword and not space:  # `OR` may be the start of `ORDER` (OR + DER)
            longer = [k[len(keyword) :] for k in _LONGER if k.startswith(keyword)]
            ids |= self._continuing("", longer, lead=False)[0]
        return ids | self.pieces.literal, End.NONE

    def _continuing(self, partial: str, forms: list[str], lead: bool) -> tuple[set[int], End]:
        low = partial.lower()
        rests = [f.lower()[len(low) :] for f in forms if f.lower().startswith(low)]
        out: set[int] = set()
        for rest in rests:
            out |= self.pieces.continuing(rest, lead)
        return out, End.ANY if "" in rests else End.NONE

    def _subquery(self, lead: bool) -> set[int]:
        return self.pieces.continuing("(", lead)


_TABLE_IN = re.compile(r"\b(?:FROM|JOIN)\s+\S", re.IGNORECASE)
# The aliases a SELECT list may name before its FROM gives them: Spider's and the generator's
# T1..T9, a single letter, and (`_initials`) a table's initials (`sc` for student_course)
ALIASES_TO_COME = tuple(f"t{i}" for i in range(1, 10)) + tuple("abcdefghijklmnopqrstuvwxyz")


def _initials(names: Names) -> set[str]:
    return {"".join(w[0] for w in re.split(r"[\W_]+", _key(t)) if w) for t in names.tables}


def _columns(names: Names, tables: set[str] | None = None) -> list[str]:
    """Every column of the tables `names` allows (of those of them in `tables`), once each."""
    return list(
        dict.fromkeys(
            f for t, cols in names.columns.items() if not tables or t in tables for f in cols
        )
    )


# A FROM or JOIN and what it names, up to the clause after it.
_FROM_CLAUSE = re.compile(
    r"\b(?:FROM|JOIN)\b(.*?)(?=\b(?:WHERE|GROUP|ORDER|HAVING|LIMIT|ON|USING|JOIN|INNER|LEFT|"
    r"RIGHT|FULL|CROSS|NATURAL|UNION|INTERSECT|EXCEPT)\b|$)",
    re.IGNORECASE | re.DOTALL,
)


def _tables_read(text: str, names: Names) -> set[str]:
    """The tables a bare column may come from where `text` ends: those FROM and JOIN name in
    the query and the subqueries still open (a correlated subquery reads the outer tables),
    not in a subquery already closed (`FROM a, b AS T2` reads both); empty, which means any
    of them, when none is the schema's or one is a subquery's result (`FROM (SELECT ...)`)."""
    if any(scopes.closes(text, m.end() - 1) for m in _DERIVED.finditer(text)):
        return set()  # a derived table: its columns are the subquery's, not the schema's
    seen = scopes.open_scopes(text)
    out = set()
    for m in _FROM_CLAUSE.finditer(seen):
        for name in re.findall(r'"[^"]+"|\w+', m.group(1)):
            if _key(name) in names.columns:
                out.add(_key(name))
    return out


# A qualified name (`T2.name`) and a bare word not followed by a dot or a parenthesis.
_QUALIFIED = re.compile(r'(?<![\w."])("[^"]+"|[A-Za-z_]\w*)\.("[^"]+"|\w+)')
_BARE = re.compile(r'(?<![\w."])("[^"]+"|[A-Za-z_]\w*)(?![\w"]|\s*[.(])')
_SELECT_LIST = re.compile(r"\s*(?:SELECT\b|\()?(.*?)(?:\bFROM\b|$)", re.IGNORECASE | re.DOTALL)
_FUNCTION_CALL = re.compile(r"\b(?:" + "|".join(_FROM_FUNCTIONS) + r")\s*\([^()]*\)", re.IGNORECASE)


def _ahead(prior: str, names: Names) -> list[str]:
    """The tables the FROM or JOIN after `prior` may name so that what the query part named
    before it can run (SQL names the columns first, and the decoder does not look back):
    the k-th table of a part is the one Spider's convention binds to Tk, so where the part
    wrote `Tk.col` before binding Tk, a table with those columns; and where the SELECT list
    named bare columns that no table named so far has, a table with all of them (else with
    some of them). A filter no table passes is left out."""
    part = _FUNCTION_CALL.sub("", scopes.part(prior))  # EXTRACT(YEAR FROM d): no table
    part = re.sub(r"'[^']*'", "''", part)
    has = {t: {_key(c) for c in cols} for t, cols in names.columns.items()}
    named = [m.group(1) for m in _FROM_CLAUSE.finditer(part)]
    read = {_key(w) for clause in named for w in re.findall(r'"[^"]+"|\w+', clause)} & set(has)
    bound = {m.group(2).lower() for m in _ALIAS.finditer(part)} | read
    needs: dict[str, set[str]] = defaultdict(set)
    for m in _QUALIFIED.finditer(part):
        if _key(m.group(1)) not in bound:
            needs[_key(m.group(1))].add(_key(m.group(2)))
    tables = names.tables
    alias = f"t{len(named) + 1}"
    if needs.get(alias):
        tables = [t for t in tables if needs[alias] <= has[_key(t)]] or tables
    head = _SELECT_LIST.match(part)
    listed = _SELECT_ALIAS.sub("", head.group(1)) if head else ""
    columns = set().union(*has.values()) if has else set()
    bare = {_key(w) for w in _BARE.findall(listed)} & columns
    bare -= set().union(*(has[t] for t in read)) if read else set()
    if bare:
        every = [t for t in tables if bare <= has[_key(t)]]
        tables = every or [t for t in tables if bare & has[_key(t)]] or tables
    return tables


_UNKEYED = re.compile(r"\b(?:CROSS|NATURAL)\s*$", re.IGNORECASE)
_DERIVED = re.compile(r"\b(?:FROM|JOIN)\s*\(", re.IGNORECASE)


def _aliases(text: str) -> tuple[set[str], set[str], set[str]]:
    """The aliases `text` gives: the tables' (`FROM t AS a`, `JOIN t a`, `FROM t a, u b`),
    the outputs' (`AS n`, `count(*) n,`) and the CTEs' names (`WITH n AS (...)`)."""
    tables = {m.group(2) for m in _ALIAS.finditer(text) if m.group(2).lower() not in _NOT_ALIAS}
    tables |= {
        m.group(2) for m in _COMMA_ALIAS.finditer(text) if m.group(2).lower() not in _NOT_ALIAS
    }
    outputs = {m.group(1) for m in _SELECT_ALIAS.finditer(text)} - tables
    outputs |= {m.group(1) for m in _BARE_ALIAS.finditer(text) if m.group(1).lower() != "from"}
    ctes = {m.group(1) for m in _CTE.finditer(text)}
    return tables, outputs - ctes, ctes


def _table_of(qualifier: str, text: str, names: Names) -> str | None:
    """The table a qualifier names: the alias the query part being written gave it (bound
    once; bound to two tables there it is ambiguous: None), or the table itself."""
    part = scopes.part(text)
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

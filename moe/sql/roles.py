"""What each table of a database offers the question templates (moe/sql/generator.py): what a
question asks for (the table's label: a name, a title, a person's first and last name, else
the key), the columns it can filter, compare, order or group on, and the foreign keys it can
join across. Read from `inspect_database`'s statistics, never from the table's name, so one
reading serves the embedded themes, Spider's databases and a user's own.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from moe.sql.sandbox import Column, Schema, Table, ident

OPS = [(">", "greater than"), ("<", "less than"), (">=", "at least"), ("<=", "at most")]
# the other words a question says a comparison in (`Tables._op`)
_OP_WORDS = {">": ("greater than", "more than", "above"), "<": ("less than", "below", "under")}
AGGS = [("AVG", "average"), ("MAX", "maximum"), ("MIN", "minimum"), ("SUM", "total")]
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
_FIRST = re.compile(r"^(first|given|fore)_?name$", re.I)
_LAST = re.compile(r"^(last|sur|family)_?name$", re.I)

Template = Callable[[random.Random], tuple[str, str] | None]

# What a column's name says its number, place or date is, so a question can also say it the
# way people ask ("the 5 longest tracks", "tracks that cost more than 0.99", "customers from
# Brazil", "the employee hired first") beside the wording that names the column. A measure and
# a place are read from the name in words (`words`), a dated event from the name whole; a
# name none of these match keeps the column's wordings alone. Not read: a unit in another
# word ("price in dollars", "length meters"), a measure of something else than the row
# ("manager age", "average age"), a place the row goes to ("ship country") or is held at
# ("location"), an adjective ("nationality": 'American'), a name in another language, a
# measure whose direction people say otherwise ("rank" 1 is the best).
_MEASURES = (  # (the last word, (the highest, the lowest), (more than, less than))
    (r"price|cost|fee|fare", ("most expensive", "cheapest"), ("cost more than", "cost less than")),
    (r"milliseconds|seconds|minutes|duration|runtime",
     ("longest", "shortest"), ("last longer than", "last less than")),
    (r"length", ("longest", "shortest"), ("are longer than", "are shorter than")),
    (r"age", ("oldest", "youngest"), ("are older than", "are younger than")),
    (r"weight", ("heaviest", "lightest"), ("weigh more than", "weigh less than")),
    (r"height", ("tallest", "shortest"), ("are taller than", "are shorter than")),
)  # fmt: skip
# the words before a measure that still make it the row's own ("unit price", "list price")
_OWN = {"unit", "list", "retail", "base", "sale", "selling", "ticket", "running", "run"}
_PLACES = re.compile(r"country|city|state|town|hometown|region|nation")
_NOT_FROM = {"ship", "shipping", "delivery", "destination", "arrival", "dest", "to"}
# a date named for what happened on it (`hiredate`, `birth_date`, `created_at`,
# `date_of_birth`): what the row did then, said after its noun ("Which employee was hired").
# Not `invoicedate` or `order_date`: "the invoice invoiced first" says it twice.
_DONE = {
    "hire": "was hired",
    "birth": "was born",
    "release": "was released",
    "start": "started",
    "join": "joined",
    "create": "was created",
    "publish": "was published",
    "found": "was founded",
    "open": "opened",
    "register": "registered",
    "sign": "signed",
    "build": "was built",
    "launch": "was launched",
    "enrol": "enrolled",
    "enroll": "enrolled",
    "death": "died",
}
_EVENT = "|".join(_DONE)
_DONE_ON = re.compile(
    rf"(?:(?P<a>{_EVENT})(?:e?d)?_?(?:date|time|day|on|at)|(?:date|day)_?of_?(?P<b>{_EVENT}))",
    re.I,
)


def measure(
    name: str, cuts: Mapping[str, str] | None = None
) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """What a numeric column's highest and lowest are called and how "more/less than" is said
    of its rows: `unit_price` -> (("most expensive", "cheapest"), ("cost more than", "cost
    less than")); None where its name is none of `_MEASURES`, or another word qualifies it
    (`manager_age`, `average_age`; `unit` and the like in `_OWN` do not)."""
    said = words(name, cuts).split() or [""]
    if len(said) > 2 or (len(said) == 2 and said[0] not in _OWN):
        return None
    for pattern, extremes, compared in _MEASURES:
        if re.fullmatch(pattern, said[-1]):
            return extremes, compared
    return None


def place(name: str, cuts: Mapping[str, str] | None = None) -> bool:
    """A column of the places rows are from (`country`, `billing city`, `hometown`), not one
    they go to (`ship country`)."""
    said = words(name, cuts).split() or [""]
    return bool(_PLACES.fullmatch(said[-1])) and not _NOT_FROM & set(said[:-1])


def done(name: str) -> str | None:
    """What the row did on the date a column records, said after its noun: `hiredate`,
    `HireDate`, `hire_date` -> 'was hired', `date_of_birth` -> 'was born', `joined_on` ->
    'joined'; None for another name."""
    m = _DONE_ON.fullmatch(name.replace(" ", ""))
    return _DONE[(m.group("a") or m.group("b")).lower()] if m else None


def words(name: str, cuts: Mapping[str, str] | None = None) -> str:
    """A column or table name as words: `unit_price` and `UnitPrice` -> 'unit price'; a part
    glued in lower case that the schema's `cuts` (from `glued`) knows is cut there:
    `billingcountry` -> 'billing country'."""
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)
    parts = s.replace("_", " ").split()
    return " ".join((cuts or {}).get(w, w) for w in parts).lower()


def glued(schema: Schema) -> dict[str, str]:
    """The schema's names (and parts between underscores) written in lower case and glued
    (`billingcountry`, Chinook's PostgreSQL port), cut before the longest other word of the
    schema they end in, where what comes before it is also a word of the schema or begins
    another such name too (`billing`: five of Chinook's). So `capacity` beside a `city` stays
    whole (`capa` is neither), as do `forename`, `average` and every CamelCase name."""
    names = [t.name for t in schema.tables] + [c.name for t in schema.tables for c in t.columns]
    vocab = {w for n in names for w in words(n).split() if len(w) >= 3}
    flat = {p for n in names if n == n.lower() for p in n.split("_") if p.isalnum()}
    out = {}
    for w in sorted(flat):
        for i in range(4, len(w) - 2):
            head, tail = w[:i], w[i:]
            shared = any(m != w and m.startswith(head) for m in flat)
            if tail in vocab and (head in vocab or shared):
                out[w] = f"{head} {tail}"
                break
    return out


def plural(phrase: str) -> str:
    w = phrase
    if re.search(r"[^siu]s$", w):
        return w  # a name already plural (Spider's `matches`, `players`): not `matcheses`
    if re.search(r"[^aeiou]is$", w):
        return w[:-2] + "es"  # analysis, basis, axis
    if re.search(r"(s|x|z|ch|sh)$", w):
        return w + "es"
    if re.search(r"[^aeiou]y$", w):
        return w[:-1] + "ies"
    return w + "s"


def article(word: str) -> str:
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def literal(v: object) -> str:
    if isinstance(v, float):
        return repr(round(v, 2))
    if isinstance(v, (int, bool)):
        return str(v)
    s = str(v)  # text, and a date or time of a server's column: a quoted literal
    return "'" + s.replace("'", "''") + "'"


def _id_like(c: Column) -> bool:
    return bool(re.search(r"(^|_)id$|Id$|ID$", c.name))


def _date_like(c: Column) -> bool:
    """A date or time column: declared so, or text whose values are all ISO dates."""
    if c.numeric:
        return False
    if re.search(r"date|time", c.type, re.I):
        return True
    return bool(c.values) and all(_ISO_DATE.match(str(v)) for v in c.values[:20])


@dataclass
class Role:
    """What a table offers the templates."""

    table: Table
    noun: str  # singular words
    nouns: str  # plural
    label: Column  # what a question asks for (a name-like column, else the key)
    labels: list[Column]  # what the SELECT lists for it: the label, or first and last name
    key: Column | None
    nums: list[Column]
    cats: list[Column]
    names: list[Column]  # text columns with mostly distinct values (a row's name)
    dates: list[Column]  # dates and times: ordered (earliest, latest), never a name
    attrs: list[Column]  # other text with values (a composer, a city): filtered by equality
    fks: list[Column]  # foreign-key columns with values: filtered by the parent's key
    cuts: Mapping[str, str] | None = None  # the schema's glued names in words (`glued`)

    @property
    def label_words(self) -> str:
        """The label in a question: 'title', or 'name' for a first and last name."""
        return "name" if len(self.labels) > 1 else words(self.label.name, self.cuts)

    @property
    def named(self) -> bool:
        """The label is a name a question can quote (not the key)."""
        return self.label in self.names


def table_roles(schema: Schema, cuts: Mapping[str, str] | None = None) -> dict[str, Role]:
    """Each table's role; `cuts`: the schema's glued names (`glued`), read here when not given."""
    out = {}
    cuts = glued(schema) if cuts is None else cuts
    for t in schema.tables:
        if not t.rows or not t.columns:
            continue
        key = next((c for c in t.columns if c.pk), None)
        fk_cols = {c.name for c in t.columns if c.references}
        free = [c for c in t.columns if not c.pk and c.name not in fk_cols]
        dates = [c for c in free if _date_like(c) and c.values]
        nums = [c for c in free if c.numeric and c.distinct > 1 and not _id_like(c)]
        cats = [c for c in free if c.categorical and not c.references and c not in dates]
        names = [
            c
            for c in free
            if not c.numeric
            and c.values
            and c.distinct >= max(2, t.rows // 2)
            and c not in cats
            and c not in dates
        ]
        attrs = [
            c
            for c in free
            if not c.numeric and c.values and c.distinct > 1 and c not in cats + names + dates
        ]
        named = [c for c in names if re.search(r"name|title", c.name, re.I)]
        label = (named or names or ([key] if key else []) or t.columns)[0]
        first = next((c for c in names if _FIRST.match(c.name)), None)
        last = next((c for c in names if _LAST.match(c.name)), None)
        labels = [label]
        if first and last:  # a person: their name is both columns
            label, labels = first, [first, last]
        fks = [c for c in t.columns if c.references and c.values and not c.pk]
        noun = words(t.name, cuts)
        out[t.name] = Role(
            t, noun, plural(noun), label, labels, key, nums, cats, names, dates,
            attrs, fks, cuts,
        )  # fmt: skip
    return out


class Tables:
    """What a database's schema offers the templates: each table's role, the foreign keys
    to join on, and the pieces every template uses."""

    def __init__(self, schema: Schema, wordings: str = "varied") -> None:
        self.schema = schema
        self.varied = wordings == "varied"  # "formal": every question in its first wording
        self.cuts = glued(schema)
        self.roles = table_roles(schema, self.cuts)
        self.joins = [
            (self.roles[child], fk, self.roles[parent], pcol)
            for child, fk, parent, pcol in schema.foreign_keys
            if child in self.roles and parent in self.roles and child != parent
        ]

    def _pick(self, rng: random.Random, need: str) -> Role | None:
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

    @staticmethod
    def _any_value(c: Column, rng: random.Random) -> object:
        """One of the column's sampled values (a name: any of them, not only the commonest)."""
        return rng.choice(c.values)

    def _lbl(self, r: Role) -> str:
        return plural(r.label_words)

    def _words(self, name: str) -> str:
        """A name of this schema as words (`words`, its glued names cut: `glued`)."""
        return words(name, self.cuts)

    def _say(self, rng: random.Random, *wordings: str, read: str | None = None) -> str:
        """One of a question's wordings, drawn evenly: the first names what the SELECT lists
        ("List the names of tracks whose ..."); the others say it as people ask it ("Which
        tracks have ...?": the table's label, as Spider's questions mean it). A model that
        saw only the first misread the plainer questions of a user (bench/RESULTS.md).
        `read`: the question in the words the column's meaning gives ("What are the 5
        longest tracks?", `measure`, `place`, `done`), which people use for such a column
        more than its name: drawn one time in two. "formal" wordings keep the first and draw
        nothing, so the draws are those made before the plainer wordings came."""
        if not self.varied:
            return wordings[0]
        if read and rng.random() < 0.5:
            return read
        return rng.choice(wordings)

    def _op(self, rng: random.Random) -> tuple[str, str]:
        """A comparison and one of the words that say it (the first when "formal")."""
        op, said = rng.choice(OPS)
        return op, rng.choice(_OP_WORDS.get(op, (said,))) if self.varied else said

    def _extreme(self, c: Column, high: bool) -> str | None:
        """The highest or lowest of a measure as people say it ('longest', 'cheapest'), or None."""
        m = measure(c.name, self.cuts)
        return m[0][not high] if m else None

    def _compared(self, c: Column, op: str) -> str | None:
        """ "more/less than" said of a measure's rows ('cost more than'), or None."""
        m = measure(c.name, self.cuts)
        return m[1][op == "<"] if m and op in (">", "<") else None

    def _from(
        self, r: Role, c: Column, v: object, asked: str = "Which {} are from {}?"
    ) -> str | None:
        """ "Which customers are from Brazil?": a place column's filter as people ask it
        (`asked`, filled with the rows' noun and the value); only for a value named as a
        place is (a capital first letter), so a `state` of 'pending' is not a place."""
        if not place(c.name, self.cuts) or not str(v)[:1].isupper():
            return None
        return asked.format(r.nouns, v)

    @staticmethod
    def _sel(r: Role, alias: str = "") -> str:
        """What the SELECT lists for the table's label: `name`, or `firstname, lastname`."""
        return ", ".join(alias + ident(c.name) for c in r.labels)

    def _join(self, rng: random.Random) -> tuple[Role, str, Role, str, str] | None:
        if not self.joins:
            return None
        child, fk, parent, pcol = rng.choice(self.joins)
        on = (
            f"{ident(parent.table.name)} AS T1 JOIN {ident(child.table.name)} AS T2"
            f" ON T1.{ident(pcol)} = T2.{ident(fk)}"
        )
        return child, fk, parent, pcol, on

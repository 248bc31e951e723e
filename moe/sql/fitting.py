"""Fitting a database's schema text to the model's lengths: `Limits` (what an example must
fit) and `fit_schema`, which shortens the schema by the stated rule (sample values first,
then column types) until every example on the database fits, or, with schema pruning on,
gives each example that does not fit the part of the schema its question needs
(moe/sql/pruning.py), or says which does not fit.
The schema the model reads is serialised from the database itself (moe/sql/sandbox.py),
once, and stored in each pair: training and evaluation read the same text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moe.errors import InputError
from moe.sql.prompts import prompt_text
from moe.sql.pruning import Pruned, Pruner, gold_tables
from moe.sql.records import Record, SqlPair
from moe.sql.sandbox import SchemaStyle

# The roles whose examples are training examples (the gold SQL's tables are kept when pruned).
TRAINING_ROLES = ("train", "train_domain")
# An example too long for its limits: (prompt + answer + end, prompt, answer, role, record)
_Over = tuple[int, int, int, str, Record]


@dataclass
class Limits:
    """What an example must fit: `count(text)` gives its tokens; the prompt at most
    `prompt_max` (model.seq_len - evaluate.max_new_tokens), a test answer at most
    `response_max` (evaluate.max_new_tokens), prompt + answer + end token at most
    `total_max[set]` (the finetune stage's max_len). `keys` names them in messages."""

    count: Callable[[list[str]], list[int]]
    prompt_max: int
    response_max: int
    total_max: dict[str, int]
    keys: dict[str, str]
    # the prompt as the model reads it (its chat template, moe/data/tokenizer.py Specials.chat)
    wrap: Callable[[str], str] = str


def _prompt(schema: str, r: Record, limits: Limits) -> str:
    pair = SqlPair(r.question, r.sql, "", schema, evidence=r.evidence, values=r.values)
    return limits.wrap(prompt_text(pair))


@dataclass
class Fitted:
    """One database's schema text for its examples: `text` (shared), a note saying what was
    left out, the longest example kept, the schema's tokens, the ids of generated records
    that do not fit even then, and the examples given a pruned schema of their own."""

    text: str
    note: str | None
    longest: int
    schema_tokens: int
    dropped: set[int]
    pruned: dict[int, Pruned] = field(default_factory=dict)


def fit_schema(
    db: Path,
    schema_of: Callable[[SchemaStyle], str],
    members: list[tuple[str, Record]],
    style: SchemaStyle,
    limits: Limits,
    pruner: Pruner | None = None,
) -> Fitted:
    """The schema text for one database, fitted to every example on it.

    Without `pruner`: the fullest `style` under which every example fits (sample values are
    dropped first, then column types). With one: the whole schema at `style` for the
    examples it fits, and for each other example the schema pruned to what its question
    needs (moe/sql/pruning.py; a training example keeps its gold SQL's tables), at `style`
    or, failing that, at the shorter styles. Either way a generated record that fits by no
    means is left out (its id in `dropped`), and a pair of the user's or of an outside corpus
    is refused with the numbers. `members` are the records on the database, each with the
    role whose limits it must fit."""
    first = style
    while True:
        text = schema_of(style)
        prompts = limits.count([_prompt(text, r, limits) for _, r in members])
        answers = limits.count([r.sql + "\n" for _, r in members])
        over = _too_long(members, prompts, answers, limits)
        schema_tokens = limits.count([text])[0]
        nxt = style.shorter()
        if not over or nxt is None or pruner is not None:
            break
        style = nxt
    lengths = {id(r): p + a + 1 for (_, r), p, a in zip(members, prompts, answers, strict=True)}
    pruned: dict[int, Pruned] = {}
    if pruner is not None and over:
        over = _prune(over, style, limits, pruner, pruned, lengths)
    _refuse_theirs(db, over, schema_tokens, limits, pruner is not None)
    dropped = {id(o[4]) for o in over}
    longest = max((n for i, n in lengths.items() if i not in dropped), default=0)
    note = _note(db, first, style, longest, over, dropped)
    if pruned:
        note = (f"{note}; " if note else f"{db.name}: ") + (
            f"{len(pruned)} example(s) given the schema pruned to what their question needs"
            f" (the whole schema is {schema_tokens} tokens)"
        )
    return Fitted(text, note, longest, schema_tokens, dropped, pruned)


def _prune(
    over: list[_Over],
    style: SchemaStyle,
    limits: Limits,
    pruner: Pruner,
    pruned: dict[int, Pruned],
    lengths: dict[int, int],
) -> list[_Over]:
    """Prune the schema for each example in `over`; those that fit are added to `pruned`
    (and their lengths updated), those that fit by no means are returned."""
    still = []
    for o in over:
        _, _, a, role, r = o
        gold = gold_tables(r.sql, pruner.schema)
        required = gold if role in TRAINING_ROLES else set()

        def fits(text: str, r: Record = r, a: int = a, role: str = role) -> bool:
            p = limits.count([_prompt(text, r, limits)])[0]
            return not _too_long([(role, r)], [p], [a], limits)

        s: SchemaStyle | None = style
        got = None
        while s is not None and got is None:
            got = pruner.prune(r.question, s, fits, required)
            s = s.shorter()
        if got is None:  # a test answer longer than its limit lands here too
            still.append(o)
            continue
        got.gold_kept = gold <= set(got.kept_tables)
        p = limits.count([_prompt(got.text, r, limits)])[0]
        pruned[id(r)] = got
        lengths[id(r)] = p + a + 1
    return still


def _too_long(
    members: list[tuple[str, Record]], prompts: list[int], answers: list[int], limits: Limits
) -> list[_Over]:
    """The examples over their limits: the prompt's, their role's total, and (a test's) the
    answer's."""
    return [
        (p + a + 1, p, a, name, r)
        for (name, r), p, a in zip(members, prompts, answers, strict=True)
        if p > limits.prompt_max
        or p + a + 1 > limits.total_max[name] + 1
        or (name not in TRAINING_ROLES and a > limits.response_max)
    ]


def _refuse_theirs(
    db: Path, over: list[_Over], schema_tokens: int, limits: Limits, pruned: bool = False
) -> None:
    """A pair of the user's or of an outside corpus that does not fit even with the
    shortest schema (or pruned, when pruning is on): refused, with the numbers of the
    longest (with the whole schema)."""
    theirs = [o for o in over if o[4].where != "generated"]
    if theirs:
        total, p, a, name, r = max(theirs, key=lambda t: t[0])
        raise InputError(
            f"{r.where} on {db.name}: the example does not fit the model"
            f"{' even with the schema pruned to its tables' if pruned else ''}: prompt {p}"
            f" tokens (the schema alone {schema_tokens}) + SQL {a} tokens + end = {total};"
            f" allowed: {limits.keys[name]} = {limits.total_max[name]} for prompt + SQL,"
            f" {limits.keys['prompt']} = {limits.prompt_max} for the prompt and"
            f" {limits.keys['response']} = {limits.response_max} for a test answer."
            f" Raise model.seq_len and the finetune stages' max_len (to at least {total}),"
            f" or shorten the schema (fewer tables or columns)"
        )


def _note(
    db: Path,
    first: SchemaStyle,
    style: SchemaStyle,
    longest: int,
    over: list[_Over],
    dropped: set[int],
) -> str | None:
    """What the fitted schema left out and how many generated pairs were too long, if any."""
    left = []
    if first.values and not style.values:
        left.append("sample values")
    if first.types and not style.types:
        left.append("column types")
    notes = []
    if left:
        notes.append(
            f"{' and '.join(left)} left out of the schema so that the examples fit"
            f" (longest example {longest} tokens)"
        )
    if dropped:
        notes.append(
            f"{len(dropped)} generated pair(s) longer than the model's lengths left out"
            f" (longest {max(o[0] for o in over)} tokens; raise model.seq_len and the"
            " finetune stages' max_len to keep them)"
        )
    return f"{db.name}: {'; '.join(notes)}" if notes else None

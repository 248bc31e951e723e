"""Execution-guided decoding with self-consistency: of several candidate queries for one
question, the answer most of them agree on.

Each candidate runs in the sandbox of the database it is for (a sqlite copy or a server,
read-only, time- and row-limited); those that fail, time out or hit the row limit are
dropped (CodeS's execution guidance). The rest are grouped by their result (Spider's
comparison, `same_result`: rows as a multiset, in order where both queries order), and the
largest group wins (self-consistency, as SLM-SQL votes); a tie goes to the group holding the
candidate the model scored highest, and the answer is that group's highest-scored query.
With no candidate that runs, the highest-scored one is the answer, as greedy decoding would
give.

With `prefer_rows`, a group whose result has rows wins over an empty one, whatever their
sizes (the execution guidance of Wang et al. 2018, which also drops candidates that return
nothing): a filter on the wrong column (`genre_id = 'Rock'`) runs, returns nothing, and
otherwise outvotes the one candidate that joined the genre's name. Rows of nothing but NULLs
(`max(...)` over no rows) count as empty; a count of 0 does not. An empty result is the
answer only when every candidate that ran returned nothing.

With `grounded` (a test of one query giving its level: moe/sql/grounding.py), a candidate
that compares a column with a value the database does not hold gets no vote, nor one whose
held value the question does not name where another candidate names the question's values
(a real doctor, not the one asked about); a held value the question does not name in any
form it knows keeps its vote against candidates that name no value. Votes tied, a group
where a candidate names the question's values wins over one where none does (one such
candidate is enough: a join naming 'Rock' beside a filter on Rock's key is as named as two
copies of a query naming 'Rock'), then the one with fewer naming a value the question does
not (the question breaks a tie, it does not overturn a majority), then the larger group
(members without a vote count here), then the group of the model's best candidate. A
group's answer is its best-grounded query. A filter on the question's own value that returns nothing keeps its
vote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moe.sql.sandbox import orders, same_result

# `evaluate.vote`: how the candidates vote, as the evaluation's report says it
VOTES = {
    "plain": "the largest group of equal results",
    "rows": "a result with rows before an empty one",
    "grounded": "only candidates whose compared values the database holds",
}


@dataclass(frozen=True)
class Choice:
    sql: str  # the answer
    agreed: int  # candidates whose result is the answer's (1 with one candidate)
    ran: int  # candidates that ran within the limits
    candidates: int


def choose(
    db: Any,
    candidates: list[tuple[str, float]],
    dialect: str = "sqlite",
    prefer_rows: bool = False,
    grounded: Callable[[str], int] | None = None,
) -> Choice:
    """The answer of `candidates` ((query, the model's log-probability of it)) on `db` (a
    sandbox with `run`); with `prefer_rows`, results with rows before empty ones; with
    `grounded` (moe/sql/grounding.py's levels: 0 unheld, 1 unnamed, 2 held, 3 named), by
    grounding (the module)."""
    ranked = sorted(candidates, key=lambda c: -c[1])  # the model's best first
    groups: list[tuple[list[Any], bool, list[str]]] = []  # (rows, ordered, queries)
    seen: dict[str, int | None] = {}  # a query text already run -> its group
    ran = 0
    for sql, _ in ranked:
        if sql in seen:  # the same text again (sampling repeats itself): the same result
            g = seen[sql]
            if g is not None:
                groups[g][2].append(sql)
                ran += 1
            continue
        got = db.run(sql)
        if not got.ok:
            seen[sql] = None
            continue
        ran += 1
        rows, ordered = got.rows or [], orders(sql, dialect)
        for i, (g_rows, g_ordered, members) in enumerate(groups):
            if same_result(rows, g_rows, ordered=ordered and g_ordered):
                members.append(sql)
                seen[sql] = i
                break
        else:
            seen[sql] = len(groups)
            groups.append((rows, ordered, [sql]))
    if not groups:
        return Choice(ranked[0][0] if ranked else "", 0, 0, len(candidates))
    # results with rows first with `prefer_rows`; then the most votes (every member without
    # `grounded`), a member naming the question's values, the fewest naming others,
    # the larger group; among equals the first formed, whose first member scored highest
    level = {q: grounded(q) for q in seen} if grounded else {}
    rival = any(level.get(q) == 3 for g in groups for q in g[2])  # a candidate names them
    votes = [sum(_votes(level.get(q, 2), rival) for q in g[2]) for g in groups]
    named = [any(level.get(q) == 3 for q in g[2]) for g in groups]  # one is enough
    unnamed = [sum(level.get(q) == 1 for q in g[2]) for g in groups]
    best = max(
        range(len(groups)),
        key=lambda i: (
            prefer_rows and _has_values(groups[i][0]),
            votes[i],
            named[i],
            -unnamed[i],  # votes tied, the question's words break the tie
            len(groups[i][2]),
            -i,
        ),
    )
    members = groups[best][2]
    answer = max(members, key=lambda q: level.get(q, 2))  # the first of the best-grounded
    return Choice(answer, len(members), ran, len(candidates))


def _votes(level: int, rival: bool) -> bool:
    """Whether a candidate of this grounding level votes (`rival`: another names the
    question's values)."""
    return level >= 2 or (level == 1 and not rival)


def _has_values(rows: list[Any]) -> bool:
    """Whether a result holds a value: a row with something other than NULL."""
    return any(any(v is not None for v in row) for row in rows)

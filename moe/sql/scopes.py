"""Where a query being written stands, for the identifier constraint (moe/sql/constrain.py):
the query part being written (`part`: an alias is bound within its part, Spider reuses T1
after INTERSECT and inside a nested query), what the query can still see (`open_scopes`), and
whether a parenthesis is closed (`closes`)."""

from __future__ import annotations

import re

# Where a query part starts.
_PART = re.compile(r"\b(?:UNION|INTERSECT|EXCEPT)\b|\(\s*SELECT\b", re.IGNORECASE)


def closes(text: str, at: int) -> bool:
    """Whether the parenthesis at `at` is closed within `text`."""
    depth = 0
    for ch in text[at:]:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return True
    return False


def open_scopes(text: str) -> str:
    """`text` without its closed parentheses' contents (a subquery done, a function's
    arguments): what the query being written can still see."""
    out: list[str] = []
    for ch in text:
        if ch == ")" and "(" in out:
            del out[len(out) - out[::-1].index("(") - 1 :]
        else:
            out.append(ch)
    return "".join(out)


_SCOPE = re.compile(r"'(?:[^']|'')*'?|\"(?:[^\"]|\"\")*\"?|\(\s*SELECT\b|[()]", re.IGNORECASE)


def part(text: str) -> str:
    """The query part being written: from its SELECT after a UNION, INTERSECT or EXCEPT, or
    an open subquery's parenthesis; a subquery already closed is left as `()` (its FROM and
    aliases are not this part's: `SELECT (SELECT count(*) FROM t) FROM`)."""
    out, at, opened = [], 0, []  # opened: where each open subquery starts in `out`, or -1
    for m in _SCOPE.finditer(text):
        out.append(text[at : m.start()])
        at, piece = m.end(), m.group()
        if piece == ")" and opened and opened[-1] >= 0:
            del out[opened.pop() :]
            piece = "()"
        elif piece == ")" and opened:
            opened.pop()
        elif piece[0] == "(":
            opened.append(len(out) if len(piece) > 1 else -1)
        out.append(piece)
    seen = "".join(out) + text[at:]
    starts = [m.start() for m in _PART.finditer(seen)]
    return seen[starts[-1] :] if starts else seen

"""Schema pruning (moe/sql/pruning.py) for whichever engine holds the database: `pruner_for`
gives a sqlite database the pruner that reads its value index through the sandbox, and a
server database `ServerPruner`, which reads the value index from the server with bounded
queries (moe/sql/reflect.py `text_values`) and keeps the dialect mark (`[postgresql] `) at
the start of every cut schema text, as the whole schema's text has it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from moe.sql.databases import Database
from moe.sql.pruning import VALUES_PER_COLUMN, Pruned, Pruner, ValueIndex
from moe.sql.schema import Schema, SchemaStyle, dialect_header
from moe.sql.server import ServerDb

_SAMPLE_ROWS = 50_000  # rows of a table the value index reads (as pruning.py's)
_WORD = re.compile(r"[a-z0-9]+")


@dataclass
class ServerPruner(Pruner):
    """Pruning for a server database: its value index from the server (reflect.py
    `text_values`), every cut schema text starting with the dialect, as the whole one does."""

    def __post_init__(self) -> None:
        self.header = dialect_header(self.schema.dialect)

    @property
    def index(self) -> ValueIndex:
        if self._index is None:
            db = self.db
            got = db.text_values(VALUES_PER_COLUMN, _SAMPLE_ROWS) if db is not None else {}
            # each value as pruning.py's index holds it: its lower-case words, one space apart
            self._index = ValueIndex(
                {
                    k: [p for v in vals if len(p := " ".join(_WORD.findall(v.lower()))) >= 2]
                    for k, vals in got.items()
                }
            )
        return self._index

    def _headed(self, text: str) -> str:
        return text if text.startswith(self.header) else self.header + text

    def prune(
        self,
        question: str,
        style: SchemaStyle,
        fits: Callable[[str], bool],
        required: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> Pruned | None:
        got = super().prune(question, style, lambda t: fits(self._headed(t)), required)
        if got is not None:
            got.text = self._headed(got.text)
        return got


def pruner_for(schema: Schema, db: Database | None) -> Pruner:
    """The schema pruner for `db` (a sqlite one reads its value index through the sandbox)."""
    if isinstance(db, ServerDb):
        return ServerPruner(schema, db)
    return Pruner(schema, db)

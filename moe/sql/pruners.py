"""Schema pruning (moe/sql/pruning.py) for whichever engine holds the database: `pruner_for`
gives a sqlite database the pruner that reads its value index through the sandbox, and a
server database `ServerPruner`, which reads the value index from the server with bounded
queries (moe/sql/reflect.py `text_values`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.sql.databases import Database
from moe.sql.pruning import SAMPLE_ROWS, VALUES_PER_COLUMN, Pruner, ValueIndex
from moe.sql.schema import Schema
from moe.sql.server import ServerDb


@dataclass
class ServerPruner(Pruner):
    """Pruning for a server database: its value index from the server (reflect.py
    `text_values`). The cut schema keeps the dialect (pruning.py `_subschema`), so its text
    starts with the dialect mark as the whole one does."""

    @property
    def index(self) -> ValueIndex:
        if self._index is None:
            db = self.db
            got = db.text_values(VALUES_PER_COLUMN, SAMPLE_ROWS) if db is not None else {}
            self._index = ValueIndex.of_texts(got)
        return self._index


def pruner_for(schema: Schema, db: Database | None) -> Pruner:
    """The schema pruner for `db` (a sqlite one reads its value index through the sandbox)."""
    if isinstance(db, ServerDb):
        return ServerPruner(schema, db)
    return Pruner(schema, db)

"""One way to open any database the SQL stages meet, and the parts that differ by engine.

- `open_database(target, time_limit_s, row_limit)`: a sqlite file (sandbox.py `ReadOnlyDb`),
  a server by URL, or the link prepare writes for one (`dbs/domain.url`; server.py
  `ServerDb`). Both have `run(sql) -> Outcome`, `schema()`, `row_limit`, `label`,
  `dialect` and `close()`: pair checks, the generator, pruning and scoring use either.
- `Databases` holds one open connection per database a prepare meets, and `check_records`
  runs every pair's SQL on its database, naming each that fails by file and line with the
  engine's message.

(Pruning's part that differs by engine is moe/sql/pruners.py's.)
"""

from __future__ import annotations

from pathlib import Path

from moe.errors import InputError
from moe.sql.records import Record
from moe.sql.sandbox import ReadOnlyDb
from moe.sql.server import LINK_SUFFIX, ServerDb, ServerLink, is_url

Database = ReadOnlyDb | ServerDb


def is_link(path: Path) -> bool:
    """Whether `path` is the link prepare writes for a server database."""
    return path.suffix == LINK_SUFFIX


def open_database(
    target: str | Path, time_limit_s: float = 2.0, row_limit: int = 10_000, password: str = ""
) -> Database:
    """A read-only, time- and row-limited connection to `target`: a sqlite file, a server
    URL (its password from `password`, e.g. env:NAME) or a link file (`dbs/domain.url`,
    which says where its password comes from)."""
    if is_url(str(target)) and not isinstance(target, Path):
        return ServerDb(ServerLink(str(target), password), time_limit_s, row_limit)
    path = Path(target)
    if is_link(path):
        return ServerDb(ServerLink.read(path), time_limit_s, row_limit)
    return ReadOnlyDb(path, time_limit_s, row_limit)


class Databases:
    """One checked, read-only connection per database (a sqlite file, or the link to a server
    database: moe/sql/databases.py `open_database`), opened on first use."""

    def __init__(self, time_limit_s: float, row_limit: int) -> None:
        self.open: dict[Path, Database | InputError] = {}
        self.time_limit_s, self.row_limit = time_limit_s, row_limit

    def get(self, path: Path) -> Database:
        if path not in self.open:
            try:
                self.open[path] = open_database(path, self.time_limit_s, self.row_limit)
            except InputError as e:
                self.open[path] = e
        got = self.open[path]
        if isinstance(got, InputError):
            raise got
        return got

    def close(self) -> None:
        for db in self.open.values():
            if not isinstance(db, InputError):
                db.close()


def check_records(records: list[Record], dbs: Databases, bad: list[str]) -> list[Record]:
    """The records whose SQL runs on their database within the limits; each other one is
    added to `bad`, named by its file and line."""
    good = []
    for r in records:
        try:
            db = dbs.get(r.db)
        except InputError as e:
            bad.append(f"{r.where}: {e}")
            continue
        out = db.run(r.sql)
        if out.ok:
            good.append(r)
        else:
            bad.append(
                f"{r.where}: the SQL does not run on {db.label} ({out.status}: {out.message})"
            )
    return good

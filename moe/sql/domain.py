"""The target domain's database, read once from the data section into what it is: the
embedded default's generated database, the user's sqlite file, or a database on a server
(a SQLAlchemy URL without a password). Each kind says how it is placed in the prepared
data, fingerprinted, reached before any compute, and which local file stands for it in the
lineage; nothing else re-reads `data.sql_domain_database` (the data section checks its
syntax: moe/data/config.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moe.data.config import DataConfig
from moe.hashing import sha256_file
from moe.sql.databases import Databases, is_link
from moe.sql.sandbox import copy_database, open_checked
from moe.sql.schema import fingerprint
from moe.sql.server import (
    LINK_SUFFIX,
    REVOKE_SIGNALS,
    ServerDb,
    ServerLink,
    is_url,
    parse_url,
    shown,
)
from moe.sql.themed import build_database
from moe.sql.themes import DOMAIN_THEME

KEY = "data.sql_domain_database"


@dataclass(frozen=True)
class DomainDatabase:
    kind: Literal["generated", "file", "server"]
    where: str = ""  # the file's path or the server's URL, as the params give it
    password: str = ""  # a server's: '', env:NAME or prefect:BLOCK (never the password)
    schema: str = ""  # a server's namespace ('' = the session's current schema)
    views: bool = False  # a server schema's views count as tables too

    @classmethod
    def of(cls, d: DataConfig) -> DomainDatabase:
        """The data section's domain database (data.sql_domain_database and its server knobs)."""
        v = d.sql_domain_database
        if is_url(v):
            return cls("server", v, d.sql_domain_password, d.sql_domain_schema, d.sql_domain_views)
        return cls("file", v) if v else cls("generated")

    @property
    def path(self) -> Path:
        """The user's sqlite file (kind file)."""
        return Path(self.where).expanduser()

    def local_input(self) -> Path | None:
        """The file whose content stands for this database in the lineage (a server has none
        DVC can hash: prepare's fingerprint record stands in for it, tasks/databases.py)."""
        return self.path if self.kind == "file" else None

    def unsafe_login(self, time_limit_s: float, row_limit: int) -> str | None:
        """A server reached (the URL, where the password comes from, the login, the schema):
        why its login may do more than read, None when it may only read (moe/sql/server.py
        `unsafe_privileges`). Nothing to reach for a file or the generated database."""
        if self.kind != "server":
            return None
        link = ServerLink(self.where, self.password, self.schema)
        with ServerDb(link, time_limit_s, row_limit) as db:
            unsafe = db.unsafe_privileges()
            if not unsafe:
                return None
            return (
                f"{KEY} = {db.label}: the model's SQL runs as this login, and it may do more"
                f" than read ({'; '.join(unsafe)}). Log in as a role that may only read, e.g."
                " CREATE ROLE moe_reader LOGIN PASSWORD '...'; GRANT CONNECT ON DATABASE <db>"
                f" TO moe_reader; GRANT USAGE ON SCHEMA {db.namespace} TO moe_reader; GRANT"
                f" SELECT ON ALL TABLES IN SCHEMA {db.namespace} TO moe_reader; {REVOKE_SIGNALS}"
                " (docs/your-data.md: Your database where it lives)"
            )

    def place(self, dbs_dir: Path, rng: random.Random, src: dict[str, str]) -> Path:
        """Put the database in `dbs_dir` and say where in `src`: the link to a server database
        (domain.url: the URL, never a password), a checked copy of the user's sqlite file, or
        the embedded default's, built from its theme (domain.sqlite)."""
        if self.kind == "server":
            url = shown(parse_url(self.where))
            path = dbs_dir / f"domain{LINK_SUFFIX}"
            ServerLink(url, self.password, self.schema, self.views).write(path)
            src["domain_database"] = url
            return path
        path = dbs_dir / "domain.sqlite"
        if self.kind == "file":
            open_checked(self.path, KEY).close()  # says what is wrong
            copy_database(self.path, path)
            src["domain_database"] = str(self.path)
        else:
            build_database(path, DOMAIN_THEME, rng, rows=40)
            src["domain_database"] = "generated"
        return path

    def fingerprint(self, dbs_dir: Path, dbs: Databases) -> dict[str, Any]:
        """What the database was at prepare: where it is (a server's URL without a password, a
        file's path) and its schema-and-row-count fingerprint (moe/sql/schema.py), a file's
        sha256 too; kept in meta.json, the prepare lineage record and the link of a server
        database, against which evaluation checks the database it meets."""
        if self.kind == "generated":
            return {"database": "generated"}
        link = dbs_dir / "domain.url"
        path = link if is_link(link) and link.is_file() else dbs_dir / "domain.sqlite"
        db = dbs.get(path)
        if path == link:
            got = {"database": db.label, **fingerprint(db.schema())}
            saved = ServerLink.read(link)
            saved.fingerprint = got
            saved.write(link)
            return got
        return {
            "database": str(self.path),
            **fingerprint(db.schema()),
            "file_sha256": sha256_file(self.path),
        }

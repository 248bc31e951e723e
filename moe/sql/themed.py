"""The embedded default's databases: a theme (moe/sql/themes.py) built into a sqlite file with
random rows, which the generator then reads like any other database."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from moe.sql.themes import SYLLABLES, Theme


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def build_database(path: Path, theme: Theme, rng: random.Random, rows: int = 30) -> None:
    """Create a sqlite database for `theme` with random rows: the embedded default's
    databases, which the generator then reads like any other."""
    (pt, pcat, pvals, pnums), (ct, ccat, cvals, cnums) = theme
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    pcols = [
        "id INTEGER PRIMARY KEY",
        "name TEXT",
        f"{pcat} TEXT",
        *(f"{n} INTEGER" for n, _, _ in pnums),
    ]
    ccols = [
        "id INTEGER PRIMARY KEY",
        f"{pt}_id INTEGER REFERENCES {pt}(id)",
        f"{ccat} TEXT",
        *(f"{n} INTEGER" for n, _, _ in cnums),
    ]
    con.execute(f"CREATE TABLE {pt} ({', '.join(pcols)})")
    con.execute(f"CREATE TABLE {ct} ({', '.join(ccols)})")
    for i in range(1, rows + 1):
        con.execute(
            f"INSERT INTO {pt} VALUES ({', '.join('?' * (3 + len(pnums)))})",
            (i, _name(rng), rng.choice(pvals), *(rng.randint(lo, hi) for _, lo, hi in pnums)),
        )
    for i in range(1, 2 * rows + 1):
        con.execute(
            f"INSERT INTO {ct} VALUES ({', '.join('?' * (3 + len(cnums)))})",
            (
                i,
                rng.randint(1, rows),
                rng.choice(cvals),
                *(rng.randint(lo, hi) for _, lo, hi in cnums),
            ),
        )
    con.commit()
    con.close()

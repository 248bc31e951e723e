"""Secrets never reach a record, a report or an artifact: `scrub` replaces the value of any
secret environment variable in a text, and of any secret this process was told of
(`remember`: a database password read from a Prefect Secret block or a variable that
data.sql_domain_password names). A leaf of tasks/ (lineage and presentation both use it).
"""

from __future__ import annotations

import os

SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "PGPASSWORD",  # libpq's own, read by the PostgreSQL driver when no other is named
)
_REMEMBERED: set[str] = set()


def remember(value: str) -> None:
    """Scrub `value` (a password this process read) from every text from now on."""
    if value and len(value) >= 4:
        _REMEMBERED.add(value)


def scrub(text: str) -> str:
    """Replace the value of any secret environment variable that leaked into `text`."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, f"<{name}>")
    for value in _REMEMBERED:
        text = text.replace(value, "<password>")
    return text

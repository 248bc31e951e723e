"""Secrets never reach a record, a report or an artifact: `scrub` replaces the value of any
secret environment variable in a text. A leaf of tasks/ (lineage and presentation both use it).
"""

from __future__ import annotations

import os

SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
)


def scrub(text: str) -> str:
    """Replace the value of any secret environment variable that leaked into `text`."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, f"<{name}>")
    return text

"""Prefect flows: one per stage, a pipeline that runs them, and the `moe-pipeline` CLI."""

import tasks as _tasks

_tasks.offline_defaults()  # before Prefect, W&B or Hugging Face read their settings

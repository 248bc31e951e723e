"""Prefect flows: one per stage, a pipeline that runs them, and the `moe-pipeline` CLI."""

import tasks as _tasks  # noqa: F401 - applies the offline defaults before Prefect is imported

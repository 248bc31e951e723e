"""The layering contract: moe/ is a pure library (imports neither prefect nor dvc), and
tasks/ does not import flows/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: str) -> dict[str, set[str]]:
    out = {}
    for f in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        out[str(f.relative_to(ROOT))] = names
    return out


def test_moe_imports_neither_prefect_nor_dvc() -> None:
    for path, names in _imports("moe").items():
        assert not names & {"prefect", "dvc", "tasks", "flows", "wandb", "boto3"}, path


def test_tasks_do_not_import_flows() -> None:
    for path, names in _imports("tasks").items():
        assert "flows" not in names, path

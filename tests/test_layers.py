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


def _task_graph() -> dict[str, set[str]]:
    """tasks/ modules -> the tasks/ modules each imports, at the top or inside a function."""
    graph: dict[str, set[str]] = {}
    for f in (ROOT / "tasks").glob("*.py"):
        if f.stem == "__init__":
            continue
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tasks."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tasks.")}
        graph[f.stem] = deps - {f.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_two_task_modules_import_each_other() -> None:
    """The launch seam (tasks/launch.py) and its leaf (tasks/runs.py): training, the
    launchers and the checkpoint hooks import each other in no circle, not even through an
    import inside a function."""
    graph = _task_graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert "training" not in graph["multinode"] and "launch" not in graph["multinode"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # it sees one

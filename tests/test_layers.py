"""The layering contract: moe/ is a pure library (imports neither prefect nor dvc), tasks/
does not import flows/, each moe/ package imports only the packages below it, no module
imports itself in a circle (lazy imports inside functions included), and no file, class or
function outgrows what a reader takes in."""

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


# What each moe/ package may import of the others (besides moe/config.py, moe/errors.py and
# moe/hashing.py, the foundation every package stands on). docs/architecture.md and
# docs/DESIGN.md draw the same picture.
MAY_IMPORT = {
    "model": set(),
    "checkpoint": set(),
    "data": set(),
    "adapters": {"model", "hf"},
    "sql": {"model", "data"},
    "hf": {"model", "checkpoint", "data"},
    "train": {"model", "checkpoint", "adapters"},
    # what a stage trains and measures: everything below, nothing of Prefect (tasks/)
    "recipes": {"model", "checkpoint", "data", "adapters", "sql", "hf", "train"},
}
FOUNDATION = {"moe.config", "moe.errors", "moe.hashing"}


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _edges(lazy: bool = True) -> dict[str, set[str]]:
    """Every project module -> the project modules it imports (at the top, and with `lazy`
    also inside functions). `from moe.train import distributed` names the module itself."""
    modules = {
        _module_of(f): f for d in ("moe", "tasks", "flows") for f in (ROOT / d).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        tree = ast.parse(f.read_text())
        nodes = ast.walk(tree) if lazy else iter(tree.body)
        deps = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in modules} - {name}
    return graph


def test_each_moe_package_imports_only_what_it_stands_on() -> None:
    for name, deps in _edges().items():
        parts = name.split(".")
        if parts[0] != "moe" or len(parts) < 3:
            continue
        allowed = MAY_IMPORT[parts[1]] | {parts[1]}
        for dep in deps - FOUNDATION:
            assert dep.split(".")[1] in allowed, f"{name} imports {dep}"


def test_no_import_circle_anywhere_lazy_imports_included() -> None:
    """A circle hidden behind an import inside a function is still a circle."""
    graph = _edges(lazy=True)
    found = _cycle(graph)
    assert found is None, " -> ".join(found or [])
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # it sees one


def test_moe_imports_its_own_modules_at_the_top() -> None:
    """No moe/ function imports a moe/ module: such an import only ever hides a circle."""
    for f in (ROOT / "moe").rglob("*.py"):
        tree = ast.parse(f.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe"):
                assert id(node) in top, f"{f.relative_to(ROOT)}:{node.lineno}"


# Declaration modules (typed config sections, data literals) may be longer: what they hold
# is read one entry at a time.
DECLARATIONS = {"moe/sql/themes.py"}


def test_no_file_class_or_function_outgrows_a_reading() -> None:
    """Files under 500 lines, classes under 300, functions under 80 (declarations aside)."""
    for d in ("moe", "tasks", "flows"):
        for f in (ROOT / d).rglob("*.py"):
            rel = f.relative_to(ROOT).as_posix()
            text = f.read_text()
            if rel not in DECLARATIONS:
                assert len(text.splitlines()) <= 500, rel
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if isinstance(node, ast.ClassDef) and rel not in DECLARATIONS:
                    assert lines <= 300, f"{rel}: class {node.name} has {lines} lines"
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert lines <= 80 or _declaration(node), (
                        f"{rel}: {node.name} has {lines} lines"
                    )


def _declaration(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A function that only builds and returns a literal (an argparse table, a manifest)."""
    body = [
        s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    return len(body) == 1 and isinstance(body[0], ast.Return)


def _module_graph() -> dict[str, set[str]]:
    """Every module of moe/, tasks/ and flows/ (dotted) -> the project modules it imports,
    at the top or inside a function."""
    graph: dict[str, set[str]] = {}
    for folder in ("moe", "tasks", "flows"):
        for f in (ROOT / folder).rglob("*.py"):
            rel = f.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            deps = set()
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    deps.add(node.module)
                    deps |= {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names}
            graph[name] = {d for d in deps if d.split(".")[0] in ("moe", "tasks", "flows")}
    return {k: {d for d in v if d in graph} for k, v in graph.items()}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_pretraining_runs_nothing_of_sql_export_evaluation_or_finetuning() -> None:
    """What pretrain's code reaches decides what reruns it (dvc.yaml lists it): a SQL,
    export, evaluation or finetune-stage edit must not reach it, not even through a chain of
    imports or an import inside a function."""
    graph = _module_graph()
    reached = _reach(graph, "tasks.pretraining") | _reach(graph, "flows.bodies.pretrain")
    banned = ("moe.sql", "moe.hf.exporter", "moe.adapters.peft", "tasks.finetuning")
    banned += ("tasks.evaluation", "tasks.publish", "flows.bodies.finetune")
    # The params tree composes every section, so each section's declaration is read by every
    # stage (the evaluate section's too: moe/sql/config.py); none of the code it configures is.
    declared = {"moe.sql.config"}
    assert sorted(m for m in reached - declared if m.startswith(banned)) == []
    assert "moe.train.trainer" in reached  # the walk sees what it runs

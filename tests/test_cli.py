"""Contract of the CLI a newcomer meets (flows/cli.py, flows/commands/params.py): it answers
at once (no torch for help, params explain, lineage or the stack's status), its help lists
what the registries hold, every argument is described, params.yaml is the embedded default
with every key commented from where it is declared, and `params explain` / `params write`
say and write the same."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path = ROOT, code: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "flows.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# What the CLI imports for each of these command lines, in a fresh interpreter: torch must not
# be among them (it takes 1-2 s to import, torch._dynamo as long again).
NO_TORCH = [
    ["--help"],
    ["params", "--help"],
    ["params", "explain", "finetune_sql.lr"],
    ["configs"],
    ["lineage", "--help"],
    ["stack", "status", "--help"],
    ["run", "--help"],
]


@pytest.mark.parametrize("argv", NO_TORCH, ids=[" ".join(a) for a in NO_TORCH])
def test_commands_that_answer_at_once_import_no_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from flows.cli import main\n"
        f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)\n"
    )
    r = _run(code=code)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last in ("NO-TORCH 0", "NO-TORCH None"), last


def test_stack_status_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from flows.cli import main\n"
        f"rc = main(['stack', 'status', '--root', {str(tmp_path)!r}])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    r = _run(code=code)
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH", r.stdout + r.stderr


def test_version() -> None:
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("moe-pipeline 0."), r.stdout


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*path, name))
    yield path, parser


def test_every_argument_is_described() -> None:
    """Each option and positional of every command has a help text (a hidden one is
    argparse.SUPPRESS on purpose)."""
    from flows.cli import COMMANDS, build_parser

    undescribed = []
    for c in COMMANDS:  # each command's own line builds its registry-read help texts
        for path, parser in _leaves(build_parser([c.name, "x", "x"])):
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    continue
                if not action.help:
                    undescribed.append(
                        f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
                    )
    assert undescribed == []


def test_every_registered_family_is_in_the_help() -> None:
    """`model import --help` and `model export --help` read the registry, not a copy."""
    from moe.hf.families.registry import FAMILIES, exporters

    imp = _run("model", "import", "--help").stdout
    exp = _run("model", "export", "--help").stdout
    flat = " ".join(imp.split())
    assert all(t in flat for t in FAMILIES), flat
    assert all(f.model_type in " ".join(exp.split()) for f in exporters())


def test_params_yaml_is_the_default_with_every_key_commented() -> None:
    """params.yaml is `params write`'s text of the embedded default, to the byte: its comments
    are the declarations' own (regenerate: moe-pipeline params write --force)."""
    from flows.commands.params import default_text
    from tasks.config import Config

    text = (ROOT / "params.yaml").read_text()
    assert text == default_text()
    assert yaml.safe_load(text) == Config().to_dict()
    lines = text.splitlines()
    # every key of a section (not the names of user-named entries: pools, stages) has a
    # comment right above it
    bare = []
    path: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith(("#", "- ")):
            continue
        indent = len(line) - len(s)
        while path and path[-1][0] >= indent:
            path.pop()
        key = s.split(":")[0]
        entry = path and path[-1][1] in ("definitions", "stages")
        if not entry and not lines[i - 1].strip().startswith("#"):
            bare.append(".".join([*(k for _, k in path), key]))
        path.append((indent, key))
    assert bare == []


def test_params_explain_says_what_the_declaration_says() -> None:
    r = _run("params", "explain", "finetune_sql.max_len")
    assert r.returncode == 0, r.stderr
    assert "prompt + response tokens" in r.stdout  # the comment beside the field
    assert "allowed: >= 8" in r.stdout and "default: 192" in r.stdout
    r = _run("params", "explain", "pools.definitions.gpu-4090.gpu_memory_gib")
    assert "default: 24" in r.stdout, r.stdout
    r = _run("params", "explain", "finetune_sql.nope")
    assert r.returncode == 2 and "no key 'nope' under finetune_sql" in r.stderr
    assert "max_len" in r.stderr  # the keys there are listed


def test_params_write_lays_a_recipe_over_the_defaults(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("# A small recipe.\n# For a test.\nfinetune_sql:\n  lr: 1.0e-4\n")
    (tmp_path / "project").mkdir()
    out = tmp_path / "project" / "params.yaml"  # cwd holds no params.yaml: the defaults
    r = _run("params", "write", "--params", str(recipe), "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = yaml.safe_load(out.read_text())
    assert got["finetune_sql"]["lr"] == 1e-4
    assert (
        got["finetune_domain"]
        == yaml.safe_load((ROOT / "params.yaml").read_text())["finetune_domain"]
    )
    assert "# A small recipe." in out.read_text()  # the recipe's own comment comes along
    # a file with other params than the defaults is not replaced without --force
    before = out.read_text()
    r = _run("params", "write", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 2 and "--force" in r.stderr and out.read_text() == before
    r = _run("params", "write", "--out", str(out), "--force", cwd=tmp_path)
    assert r.returncode == 0 and yaml.safe_load(out.read_text())["finetune_sql"]["lr"] == 2e-3


def test_the_old_positional_params_file_is_refused_with_the_new_spelling(tmp_path: Path) -> None:
    r = _run("params", "check", str(ROOT / "params.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "--params" in r.stderr


def test_params_write_keeps_an_auto_pool(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("pools:\n  stages:\n    finetune_sql: auto\n")
    out = tmp_path / "p.yaml"
    r = _run("params", "write", "--params", str(recipe), "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(out.read_text())["pools"]["stages"]["finetune_sql"] == "auto"

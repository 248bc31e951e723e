"""Every command the README and the guides (docs/) show works as written: each `moe-pipeline`
line parses with the CLI's own parser, each `--set`/`-S KEY=VALUE` passes the params check
(the KEY=VALUE pairs of one line together), each params snippet in a ```yaml block names real
keys with values of the right type, and every recipe or guide a page links to exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def _lines(text: str, inline: bool = True) -> list[str]:
    """The shell lines of a page's code blocks (continuations joined, comments cut) and, with
    `inline`, its inline `code` spans."""
    out = []
    for lang, body in _blocks(text):
        if lang not in ("", "bash", "sh", "console", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            out.append(line.split(" #")[0].strip().removeprefix("$ "))
    if inline:
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        out += re.findall(r"`([^`\n]+)`", prose)
    return out


# A synopsis (`ask DIR QUESTION [--candidates N]`, `stack up|status`) names a command and its
# arguments in words: only its command words are held to the CLI.
SYNOPSIS = re.compile(r"[\[|]|\b[A-Z][A-Z_]+\b|\.\.\.")


def _commands(text: str) -> list[tuple[list[str], bool]]:
    """(the arguments after `moe-pipeline`, whether the line is a whole command to parse) of
    each line that shows one: a code block's line is whole unless it is a synopsis; an inline
    span in prose only names a command."""
    blocks = set(_lines(text, inline=False))
    cmds = []
    for line in _lines(text):
        m = re.search(r"(?:^|[\s/])moe-pipeline\s+(.*)$", line)
        if not m:
            continue
        try:
            argv = shlex.split(m.group(1))
        except ValueError:
            continue
        argv = [a for a in argv if not a.startswith(("|", ">"))]
        if argv and re.fullmatch(r"[a-z-]+", argv[0]):
            cmds.append((argv, line in blocks and not SYNOPSIS.search(m.group(1))))
    return cmds


def _command_words_exist(argv: list[str]) -> bool:
    """The leading words of `argv` are a path of the CLI's commands (up to its first option or
    argument)."""
    import argparse

    from flows.cli import build_parser

    parser = build_parser(argv)
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return True
        names = subs[0].choices
        first = word.split("|")[0]
        if first not in names:
            return False
        parser = names[first]
    return True


def _sets(text: str) -> list[list[str]]:
    """The KEY=VALUE pairs given with --set or -S, one list per line that gives them."""
    found = []
    for line in _lines(text):
        pairs = re.findall(r"(?:--set|-S)[ =]([A-Za-z_][\w.\-]*=\S*)", line)
        if pairs:
            found.append(pairs)
    return found


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_cli_line_parses(page: Path) -> None:
    from flows.cli import build_parser

    bad = []
    for argv, whole in _commands(page.read_text()):
        if not whole:
            if not _command_words_exist(argv):
                bad.append(" ".join(argv))
            continue
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as e:
            if e.code:  # --help and --version exit 0
                bad.append(" ".join(argv))
    assert bad == [], f"{page.name}: lines the CLI refuses: {bad}"


def test_the_readme_shows_commands() -> None:
    """The extraction itself finds what the README shows (a parser that finds nothing
    would pass every page)."""
    text = (ROOT / "README.md").read_text()
    whole = [argv for argv, full in _commands(text) if full]
    assert any(c[:1] == ["plan"] for c in whole) and any(c[:1] == ["run"] for c in whole)
    docs = " ".join(p.read_text() for p in PAGES)
    assert len(_sets(docs)) >= 10


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_set_passes_params_check(page: Path) -> None:
    from moe.errors import InputError
    from tasks.config import load_config

    bad = []
    for pairs in _sets(page.read_text()):
        try:
            load_config(ROOT / "params.yaml", pairs)
        except InputError as e:
            bad.append(f"{' '.join(pairs)}: {e}")
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_params_snippet_names_real_keys(page: Path) -> None:
    """A ```yaml block whose top-level keys are params sections: no unknown key, no value of
    the wrong type (paths it names need not exist here)."""
    from moe.config import ConfigError
    from tasks.config import Config, from_dict

    sections = set(Config().to_dict())
    bad = []
    for lang, body in _blocks(page.read_text()):
        if lang != "yaml":
            continue
        try:
            raw = yaml.safe_load(body)
        except yaml.YAMLError as e:
            bad.append(f"not YAML: {e}")
            continue
        if not isinstance(raw, dict) or not set(raw) <= sections:
            continue
        try:
            from_dict(raw, resolve=False, check_fit=False)
        except ConfigError as e:
            bad += [p for p in e.problems if "unknown key" in p or "expected" in p]
    assert bad == [], f"{page.name}: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_local_link_and_recipe_exists(page: Path) -> None:
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    missing += [c for c in re.findall(r"configs/[\w.\-]+\.yaml", text) if not (ROOT / c).is_file()]
    assert missing == [], f"{page.name}: {missing}"


def test_the_front_page_is_a_front_page() -> None:
    """At most 300 lines; what it is, the two commands, the models table and bringing a
    model within the first 80."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    head = "\n".join(lines[:80])
    assert "text-to-SQL" in "\n".join(lines[:5])
    assert "make demo" in head and "make test" in head
    assert "## Supported models" in head and "configs/" in head

"""`moe-pipeline params check|show|explain|write` and `moe-pipeline configs`: the
configuration read, explained from where each field is declared, and written as a params file
whose every key carries its declaration's comment. Imports no torch unless a check needs the
model's memory (a pool's fit, model.init's architecture)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml

from flows.commands import EXIT_CONFIG
from moe.config import allowed_range, field_docs, type_name
from moe.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"  # the recipes: one params file per model and method
WIDTH = 99  # the project's line length (pyproject.toml's ruff line-length)


# --------------------------------------------------------------------------- the commands


def _no_positional(args: argparse.Namespace) -> None:
    if getattr(args, "file", None):
        raise InputError(
            f"the params file is named with --params, as in every command: moe-pipeline params "
            f"{args.params_command} --params {args.file}"
        )


def check(args: argparse.Namespace) -> int:
    from tasks.config import load_config

    _no_positional(args)
    load_config(args.params, args.overrides)
    src = args.params or ("params.yaml" if Path("params.yaml").is_file() else "embedded default")
    print(f"{src}: OK")
    return 0


def show(args: argparse.Namespace) -> int:
    from tasks.config import load_config

    _no_positional(args)
    cfg = load_config(args.params, args.overrides)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def explain(args: argparse.Namespace) -> int:
    print(describe(args.key))
    return 0


HEAD = [
    "The pipeline's params: every knob, with what it means (the comment where it is declared).",
    "Written by `moe-pipeline params write`; `moe-pipeline params explain KEY` says more of one.",
    "A recipe in configs/ holds only what differs from these: moe-pipeline run --params FILE.",
]


def default_text() -> str:
    """params.yaml as the project ships it: the embedded default, every key commented."""
    return commented_yaml(_default_dict(), HEAD)


def write(args: argparse.Namespace) -> int:
    """The params file laid over the defaults (not resolved: model.init's folder need not
    exist yet), checked, written with a comment on every key. A file that holds other params
    than the defaults is replaced only with --force."""
    from moe.recipes.params import deep_merge, read_params
    from tasks.config import from_dict

    raw, lines, source = read_params(args.params, args.overrides)
    cfg = from_dict(raw, lines, source, resolve=False, check_fit=False)
    tree = cfg.to_dict()
    # the check resolves `pools.stages.X: auto` to a pool; the file keeps what was written
    stages = deep_merge(_default_dict()["pools"]["stages"], raw.get("pools", {}).get("stages", {}))
    tree["pools"]["stages"].update({k: v for k, v in stages.items() if v == "auto"})
    given = "".join(f" --set {o}" for o in args.overrides)
    head = HEAD
    if args.params or given:
        head = [
            f"Written by `moe-pipeline params write"
            f"{f' --params {args.params}' if args.params else ''}{given}`: laid over the "
            "defaults, every key commented (moe-pipeline params explain KEY says more).",
        ]
        if args.params:
            head += ["", *recipe_head(Path(args.params))]
    text = commented_yaml(tree, head)
    out = Path(args.out)
    if (
        out.exists()
        and not args.force
        and out.read_text(errors="replace")
        not in (
            text,
            default_text(),
        )
    ):
        raise InputError(
            f"{out} exists and holds other params than the defaults: keep it (write elsewhere "
            f"with --out FILE) or replace it with --force"
        )
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"{out}: written from {source}")
    return 0


def configs(args: argparse.Namespace) -> int:
    """Each recipe of configs/ with the first line of its comment."""
    files = sorted(CONFIGS.glob("*.yaml"))
    if not files:
        print(f"no recipes in {CONFIGS}", file=sys.stderr)
        return EXIT_CONFIG
    width = max(len(str(f.relative_to(ROOT))) for f in files)
    for f in files:
        first = next(iter(recipe_head(f)), "")
        print(f"{str(f.relative_to(ROOT)):{width}s}  {first}")
    print("\nUse one: moe-pipeline plan --params configs/NAME.yaml, then run --params likewise.")
    return 0


def recipe_head(path: Path) -> list[str]:
    """The comment block a params file starts with, without its `#`s."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        out.append(line[2:] if line.startswith("# ") else line[1:])
    return out


# --------------------------------------------------------------------------- explaining


def _config_cls() -> type:
    from tasks.config import Config

    return Config


def _default_dict() -> dict[str, Any]:
    return _config_cls()().to_dict()


def _field(cls: type, name: str) -> dataclasses.Field | None:
    return next((f for f in dataclasses.fields(cls) if f.name == name), None)


def lookup(key: str) -> tuple[type | None, str, Any, Any]:
    """(the dataclass that declares the last part of `key`, that part, its type, its default)
    for a dotted key; a mapping entry (pools.definitions.NAME) is walked through its value type.
    Raises InputError naming the keys allowed where the path goes wrong."""
    cls: Any = _config_cls()
    value: Any = cls()
    parts = key.split(".")
    owner: type | None = None
    tp: Any = cls
    name = ""
    i = 0
    while i < len(parts):
        name = parts[i]
        if dataclasses.is_dataclass(tp):
            f = _field(tp, name)
            if f is None:
                names = ", ".join(f.name for f in dataclasses.fields(tp))
                where = ".".join(parts[:i]) or "the top level"
                raise InputError(f"{key}: no key {name!r} under {where}; keys there: {names}")
            owner, tp = tp, typing.get_type_hints(tp)[name]
            value = getattr(value, name)
        elif get_origin(tp) is dict:
            val_tp = get_args(tp)[1]
            if not (isinstance(value, dict) and name in value) and not dataclasses.is_dataclass(
                val_tp
            ):
                have = ", ".join(value) if isinstance(value, dict) else ""
                raise InputError(f"{key}: no entry {name!r}; entries: {have}")
            value = value.get(name, val_tp() if dataclasses.is_dataclass(val_tp) else None)
            tp = val_tp
            if not dataclasses.is_dataclass(tp):
                owner = None
        else:
            raise InputError(f"{key}: {'.'.join(parts[:i])} is a value, not a section")
        i += 1
    return owner, name, tp, value


def doc_of(owner: type | None, name: str) -> str:
    if owner is None:
        return ""
    return field_docs(owner).get(name, "")


def describe(key: str) -> str:
    """What `params explain KEY` prints: the key's description (the comments where its field is
    declared), its type, what it allows and its default; for a section, each of its keys."""
    owner, name, tp, default = lookup(key)
    lines = [key]
    doc = doc_of(owner, name)
    if dataclasses.is_dataclass(tp):
        if doc:
            lines += textwrap.wrap(doc, WIDTH - 2, initial_indent="  ", subsequent_indent="  ")
        lines.append("  keys:")
        for f in dataclasses.fields(tp):
            first = _first_sentence(field_docs(tp).get(f.name, ""))
            lines.append(f"    {f.name}: {first}" if first else f"    {f.name}")
        lines.append(f"  explain one: moe-pipeline params explain {key}.KEY")
        return "\n".join(lines)
    if doc:
        lines += textwrap.wrap(doc, WIDTH - 2, initial_indent="  ", subsequent_indent="  ")
    lines.append(f"  type: {type_name(tp)}")
    f = _field(owner, name) if owner is not None else None
    if f is not None and "bounds" in f.metadata:
        lines.append(
            f"  allowed: {allowed_range(*f.metadata['bounds']).removeprefix('must be ')}{f.metadata['note']}"
        )
    elif f is not None and "pattern" in f.metadata:
        lines.append(f"  allowed: {f.metadata['note']}")
    lines.append(f"  default: {_scalar(default)}")
    return "\n".join(lines)


def _first_sentence(doc: str) -> str:
    for end in (". ", "; "):
        if end in doc:
            return doc.split(end, 1)[0] + ("." if end == ". " else "")
    return doc


# --------------------------------------------------------------------------- writing


def _scalar(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6)
        .strip()
        .removesuffix("\n...")
        .removesuffix("...")
        .strip()
    )


def key_comment(cls: type | None, name: str) -> str:
    """The one-line comment of a params key: the first sentence of its declaration's comment."""
    return _first_sentence(doc_of(cls, name))


def commented_yaml(tree: dict[str, Any], head: list[str] | None = None) -> str:
    """`tree` (a configuration as Config.to_dict() gives it) as YAML with the declaration's
    comment above every key (moe/config.py field_docs: the comment a reader of the dataclass
    sees); yaml.safe_load of the text gives `tree` back."""
    out: list[str] = []
    for h in head or []:  # a line that fits is kept as it is (a recipe's own indentation)
        wrapped = textwrap.wrap(h, WIDTH, initial_indent="# ", subsequent_indent="# ")
        out += [f"# {h}".rstrip()] if len(h) + 2 <= WIDTH else wrapped
    if out:
        out.append("")
    _emit(_config_cls(), tree, 0, out)
    return "\n".join(out) + "\n"


def _comment(text: str, indent: int, out: list[str]) -> None:
    if text:
        pad = " " * indent
        out += textwrap.wrap(text, WIDTH, initial_indent=f"{pad}# ", subsequent_indent=f"{pad}# ")


def _emit(cls: type, tree: dict[str, Any], indent: int, out: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    pad = " " * indent
    for name, value in tree.items():
        tp = hints[name]
        _comment(key_comment(cls, name), indent, out)
        if dataclasses.is_dataclass(tp):
            out.append(f"{pad}{name}:")
            _emit(tp, value, indent + 2, out)
        elif get_origin(tp) is dict and value and dataclasses.is_dataclass(get_args(tp)[1]):
            out.append(f"{pad}{name}:")
            for entry, sub in value.items():
                out.append(f"{pad}  {entry}:")
                _emit(get_args(tp)[1], sub, indent + 4, out)
        elif isinstance(value, (dict, list)) and value:
            out.append(f"{pad}{name}:")
            block = yaml.safe_dump(value, sort_keys=False, default_flow_style=False)
            inner = pad if isinstance(value, list) else pad + "  "  # as yaml.safe_dump nests
            out += [f"{inner}{line}" for line in block.splitlines()]
        else:
            out.append(f"{pad}{name}: {_scalar(value)}")

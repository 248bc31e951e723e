"""How the library's configuration is declared, built and checked; the sections themselves
live beside the code they configure (`moe/<part>/config.py`): data and tokenizer in
moe/data/config.py, model and moe in moe/model/config.py, the adapters' lora in
moe/adapters/config.py, the training sections in moe/train/config.py, checkpoint in
moe/checkpoint/config.py, evaluate in moe/sql/config.py. Their defaults *are* the embedded
default: a tiny model that runs the whole pipeline on a 2-core CPU in minutes. The recipes'
params tree (moe/recipes/params.py) composes them; tasks/config.py adds how the pipeline
runs (storage, pools, cost, recovery, multi-node, W&B).

`build` turns a nested mapping into a section; `validate` checks what each field declares
(`knob`: a range or a pattern), every nested section, then the section's own `check` (the
rules across fields), adding what is wrong to a `Problems`; all are reported together, each
with its key path, the offending value, what is allowed and (when read from a file) the line.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import math
import re
import textwrap
import tokenize
import typing
from dataclasses import field
from typing import Any, Literal, get_args, get_origin

from moe.errors import InputError


class ConfigError(InputError):
    """One or more configuration problems; `str()` lists each on its own line."""

    def __init__(self, problems: list[str], source: str = "params") -> None:
        self.problems = problems
        self.source = source
        super().__init__(
            f"{source}: {len(problems)} problem(s) in the configuration:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


FROM_SET = -1  # line marker: the value came from a --set override


class Problems:
    """Collects problems with their key paths; `section()` nests the path."""

    def __init__(self, lines: dict[str, int] | None = None, filename: str = "") -> None:
        self.items: list[str] = []
        self.prefix: list[str] = []
        self.lines = lines or {}
        self.filename = filename

    def section(self, name: str) -> _Section:
        return _Section(self, name)

    def add(self, key: str, value: Any, why: str) -> None:
        """`key = value: why (file, line N)`."""
        path = self._path(key)
        self.items.append(f"{path} = {value!r}: {why}{self._where(path)}")

    def note(self, key: str, why: str) -> None:
        """`key: why (file, line N)`: a problem with a whole key rather than its value."""
        path = self._path(key)
        self.items.append(f"{path}: {why}{self._where(path)}")

    def _path(self, key: str) -> str:
        return ".".join([*self.prefix, key]) if key else ".".join(self.prefix)

    def _where(self, path: str) -> str:
        line = self.lines.get(path)
        if line is None:  # fall back to the nearest enclosing key with a known line
            parts = path.split(".")
            while parts and line is None:
                parts.pop()
                line = self.lines.get(".".join(parts))
        if line == FROM_SET:
            return " (from --set)"
        if line is not None and self.filename:
            return f" ({self.filename}, line {line})"
        return ""

    def require(self, ok: bool, key: str, value: Any, why: str) -> None:
        if not ok:
            self.add(key, value, why)


class _Section:
    def __init__(self, problems: Problems, name: str) -> None:
        self.problems, self.name = problems, name

    def __enter__(self) -> None:
        self.problems.prefix.append(self.name)

    def __exit__(self, *exc: object) -> None:
        self.problems.prefix.pop()


def knob(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    pattern: str | None = None,
    note: str = "",
) -> Any:
    """A field with what it allows declared beside it. `validate` refuses a number outside
    its range as "must be >= 1", "must be in (0, 1]" and so on, followed by `note`; a string
    that does not match `pattern` (the whole of it) as "must be <note>"."""
    if pattern is not None:
        return field(default=default, metadata={"pattern": pattern, "note": note})
    return field(default=default, metadata={"bounds": (ge, gt, le, lt), "note": note})


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def allowed_range(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    lo = f"[{_number(ge)}" if ge is not None else f"({_number(gt)}" if gt is not None else ""
    hi = f"{_number(le)}]" if le is not None else f"{_number(lt)})" if lt is not None else ""
    if lo and hi:
        return f"must be in {lo}, {hi}"
    if lo:
        return f"must be >= {_number(ge)}" if ge is not None else f"must be > {_number(gt)}"
    return f"must be <= {_number(le)}" if le is not None else f"must be < {_number(lt)}"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """What the source says about each field of the config dataclass `cls`: the comment
    lines right above it and the comments on its own line(s), joined into one text (the
    Prefect form's descriptions, tasks/form.py). One source of truth: the comment a reader of
    this file sees is the description a user of the form sees."""
    src = textwrap.dedent(inspect.getsource(cls))
    docs: dict[str, str] = {}
    above: list[str] = []
    name: str | None = None
    parts: list[str] = []
    start = True  # at the start of a logical line of the class body
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if name is not None:
                parts.append(text)
            elif start and tok.start[1] == 4:  # a comment line of the body, not a method's
                above.append(text)
            continue
        if tok.type == tokenize.NL:
            continue
        if tok.type == tokenize.NEWLINE:
            if name is not None:
                docs[name] = " ".join([*above, *parts]).strip()
            name, parts, above, start = None, [], [], True
            continue
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            continue
        if start:
            start = False
            if tok.type == tokenize.NAME and tok.start[1] == 4:
                name = tok.string  # kept below only if it names a field
            else:
                above = []
    fields = {f.name for f in dataclasses.fields(cls)}
    own = {k: v for k, v in docs.items() if k in fields}
    for base in cls.__mro__[1:]:  # inherited fields keep their base's comments
        if dataclasses.is_dataclass(base):
            own = {**field_docs(base), **own}
    return {k: v for k, v in own.items() if k in fields}


def validate(section: Any, p: Problems) -> None:
    """The one validation path of every section: each field's declared range (`knob`), each
    nested section and mapping of sections under its key path, then the section's own
    `check`, which holds only the rules that relate fields to each other."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "bounds" in f.metadata and isinstance(value, (int, float)):
            ge, gt, le, lt = f.metadata["bounds"]
            ok = (
                (ge is None or value >= ge)
                and (gt is None or value > gt)
                and (le is None or value <= le)
                and (lt is None or value < lt)
            )
            p.require(ok, f.name, value, allowed_range(ge, gt, le, lt) + f.metadata["note"])
        elif "pattern" in f.metadata:
            ok = isinstance(value, str) and re.fullmatch(f.metadata["pattern"], value) is not None
            p.require(ok, f.name, value, f"must be {f.metadata['note']}")
        elif dataclasses.is_dataclass(value):
            with p.section(f.name):
                validate(value, p)
        elif isinstance(value, dict):
            for key, item in value.items():
                if dataclasses.is_dataclass(item):  # None: refused when it was built
                    with p.section(f"{f.name}.{key}"):
                        validate(item, p)
    if hasattr(section, "check"):
        section.check(p)


# auto, cpu, cuda or cuda:N: where a stage trains or evaluates.
DEVICE = r"auto|cpu|cuda(:\d+)?"


# --------------------------------------------------------------------------- building


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(
            str(a).lower() if isinstance(a, bool) else repr(a) for a in get_args(tp)
        )
    if origin in (list, dict):
        return str(tp).replace("typing.", "")
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, str(tp)
    )


def _convert(value: Any, tp: Any, p: Problems, key: str) -> Any:
    """Convert a YAML value to `tp`, recording a problem (and returning None) on mismatch."""
    origin = get_origin(tp)
    bad = object()
    out: Any = bad
    if dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            with p.section(key):
                return build(tp, value, p)
    elif origin is Literal:
        if value in get_args(tp):
            out = value
    elif origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, list):
            items = [_convert(v, item_tp, p, f"{key}[{i}]") for i, v in enumerate(value)]
            return items
    elif origin is dict:
        _, val_tp = get_args(tp)
        if isinstance(value, dict):
            with p.section(key):
                return {str(k): _convert(v, val_tp, p, str(k)) for k, v in value.items()}
    elif tp is bool:
        if isinstance(value, bool):
            out = value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            out = value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):
            # PyYAML reads "3e-4" (no dot) as a string; accept any float() literal.
            try:
                out = float(value)
            except ValueError:
                pass
        if out is not bad and not math.isfinite(out):
            # No knob means anything at inf or nan: refused here, once, for every float field.
            p.add(key, value, "must be a finite number (not inf or nan)")
            return None
    elif tp is str:
        if isinstance(value, str):
            out = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out = str(value)
    if out is bad:
        p.add(key, value, f"expected {type_name(tp)}")
        return None
    return out


def build(cls: type, raw: dict[str, Any], p: Problems) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            p.add(str(key), value, f"unknown key; allowed keys here: {', '.join(sorted(names))}")
            continue
        converted = _convert(value, hints[key], p, key)
        if converted is not None:
            kwargs[key] = converted
    obj = cls(**kwargs)
    return obj

"""The run form (tasks/form.py) as Prefect derives it from the flows' signatures: every field
of the configuration with its default, type, declared range or choices and description, one
group per section; the schema refuses what the config refuses; what the form sends reaches
the stage; an unknown key is refused with the config's own message. The Chromium test of the
form on a real server is in tests/test_stack.py."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from moe.config import ConfigError
from tasks.config import Config, load_config
from tasks.pools import STAGES
from tests.conftest import ROOT


def _schema(fn: Any) -> dict[str, Any]:
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(fn).model_dump()


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """A property's schema with its $ref (or the model branch of an anyOf with null) looked
    up, as the UI does to render it."""
    for branch in node.get("anyOf", []):
        if "$ref" in branch:
            node = branch
    if "$ref" in node:
        return schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _leaves(schema: dict[str, Any], node: dict[str, Any], path: str = "") -> dict[str, dict]:
    """Every field of the form, by key path, with its schema (sections included)."""
    out = {}
    for name, prop in node.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        out[here] = prop
        target = _resolve(schema, prop)
        if target.get("type") == "object" and "properties" in target:
            out.update(_leaves(schema, target, here))
    return out


@pytest.fixture(scope="module")
def form() -> tuple[dict[str, Any], dict[str, dict]]:
    from flows.pipeline import pipeline

    schema = _schema(pipeline.fn)
    params = _resolve(schema, schema["properties"]["params"])
    return schema, _leaves(schema, params)


def _dataclass_paths(cls: type, path: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        here = f"{path}.{f.name}" if path else f.name
        out.append(here)
        if dataclasses.is_dataclass(hints[f.name]):
            out += _dataclass_paths(hints[f.name], here)
    return out


def test_every_field_of_the_config_is_on_the_form_with_a_description(form: Any) -> None:
    schema, fields = form
    for path in _dataclass_paths(Config):  # one source: the dataclasses
        assert path in fields, f"{path} is not on the form"
        text = fields[path].get("description")
        assert text, f"{path} has no description (its comment)"
        # the UI renders it as markdown: no HTML-like <tags> (swallowed), no quote marker
        assert "<" not in text and not text.startswith(">"), (path, text)
    # one group per section, in the config's order
    params = _resolve(schema, schema["properties"]["params"])
    assert list(params["properties"]) == [f.name for f in dataclasses.fields(Config)]
    assert params["additionalProperties"] is False
    assert _resolve(schema, fields["pretrain"])["additionalProperties"] is False


def _source_comment(cls: type, name: str) -> str:
    """The comment a reader of the config's source sees for field `name` of `cls`, read
    line by line (independently of moe.config.field_docs' tokenizer): the comment lines
    right above its declaration, then the comments on the declaration's own line(s)."""
    import inspect
    import re
    import textwrap

    owner = next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))
    lines = textwrap.dedent(inspect.getsource(owner)).splitlines()
    [i] = [k for k, line in enumerate(lines) if re.match(rf"    {name}\s*:", line)]
    above: list[str] = []
    k = i - 1
    while k >= 0 and lines[k].startswith("    #"):
        above.insert(0, lines[k].strip().lstrip("#").strip())
        k -= 1
    parts, depth = [], 0
    for line in lines[i:]:
        if line.strip().startswith("#"):
            code, comment = "", line.strip()[1:]
        else:
            code, _, comment = line.partition("  #")
        if comment.strip():
            parts.append(comment.strip())
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0:
            break
    return " ".join([*above, *parts]).strip()


def test_each_fields_description_is_its_own_comment(form: Any) -> None:
    """What the UI shows under a field is that field's comment in the config's source, not
    its neighbour's (above or below it) nor a section's: every field, every section."""
    _, fields = form

    def walk(cls: type, path: str = "") -> Any:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            here = f"{path}.{f.name}" if path else f.name
            yield cls, f.name, here
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], here)

    checked = 0
    for cls, name, path in walk(Config):
        want = _source_comment(cls, name)
        assert want, f"{cls.__name__}.{name} has no comment in the source"
        assert fields[path].get("description") == want, path
        checked += 1
    assert checked > 200  # every field of the config, not a sample
    # the three shapes a comment takes in the source, each its own field's
    assert fields["pretrain.lr"]["description"] == "peak learning rate (AdamW)"
    assert fields["pretrain.time_budget_s"]["description"].startswith("Above 0: stop after")
    assert fields["cost.alert_fraction"]["description"] == (
        "warn when spend passes this fraction of the budget"
    )


def test_declared_ranges_and_choices_are_the_schemas(form: Any) -> None:
    _, f = form
    assert f["pretrain.lr"]["exclusiveMinimum"] == 0 and f["pretrain.lr"]["type"] == "number"
    assert f["checkpoint.hot_level"]["minimum"] == 1 and f["checkpoint.hot_level"]["maximum"] == 22
    assert f["data.val_fraction"]["exclusiveMaximum"] == 0.5
    assert f["pretrain.device"]["pattern"] == r"^(?:auto|cpu|cuda(:\d+)?)$"
    assert f["wandb.mode"]["enum"] == ["offline", "online", "disabled"]
    cfg = load_config(ROOT / "params.yaml")
    pools = sorted([*cfg.pools.definitions, "auto"])  # auto: the cheapest that fits
    for stage in STAGES:  # a stage's pool is a choice of the defined pools
        assert sorted(f[f"pools.stages.{stage}"]["enum"]) == pools
    # the defaults are the project's params.yaml
    assert f["pretrain.lr"]["default"] == cfg.pretrain.lr
    assert f["finetune_domain.max_steps"]["default"] == cfg.finetune_domain.max_steps
    assert f["pools.stages.pretrain"]["default"] == cfg.pools.stages["pretrain"]


def test_stages_is_a_multi_select_of_the_stage_names() -> None:
    from flows.pipeline import pipeline

    stages = _schema(pipeline.fn)["properties"]["stages"]
    [array] = [b for b in stages["anyOf"] if b.get("type") == "array"]
    assert array["items"]["enum"] == list(STAGES)


def test_the_schema_refuses_what_the_config_refuses() -> None:
    """Prefect validates a run's parameters against the schema (the UI's form, a deployment
    with enforce_parameter_schema) with its own validator: lr 0 and an unknown key fail
    there; the project's own configuration passes."""
    from prefect.utilities.schema_tools import validate

    from flows.pipeline import pipeline

    schema = _schema(pipeline.fn)
    ok = {"params": load_config(ROOT / "params.yaml").to_dict()}
    validate(ok, schema, raise_on_error=True)

    def errors(params: dict) -> str:
        with pytest.raises(Exception) as e:  # noqa: PT011 - Prefect's own validation error
            validate({"params": params}, schema, raise_on_error=True)
        return str(e.value)

    bad = load_config(ROOT / "params.yaml").to_dict()
    bad["pretrain"]["lr"] = 0
    assert "lr" in errors(bad)
    bad = load_config(ROOT / "params.yaml").to_dict()
    bad["pretrain"]["lrr"] = 1e-3
    assert "lrr" in errors(bad)
    bad = load_config(ROOT / "params.yaml").to_dict()
    bad["pools"]["stages"]["pretrain"] = "gpu-b200"
    assert "gpu-b200" in errors(bad)


def test_what_the_form_sends_reaches_the_stage_and_a_bad_key_is_one_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flows take the form's model (a direct call) or its JSON (a deployment run): a
    changed value arrives; an unknown key or a value out of range is refused by load_config
    with the message a params file or --set gets, before any stage runs."""
    from flows.pipeline import pipeline
    from flows.stages import Params
    from tasks.form import as_params

    form = Params()
    form.pretrain.lr = 1e-3
    assert load_config(params=as_params(form)).pretrain.lr == 1e-3
    sent = form.model_dump(mode="json")  # what a deployment run carries
    assert load_config(params=as_params(sent)).pretrain.lr == 1e-3

    def refused(params: dict) -> str:
        with pytest.raises(ConfigError) as e:
            pipeline.fn(params=params, stages=["prepare"])
        return str(e.value)

    sent["pretrain"]["lrr"] = 1
    via_set = pytest.raises(ConfigError, load_config, None, ["pretrain.lrr=1"]).value
    assert "pretrain.lrr" in refused(sent)
    # the same line, but for where the value came from
    assert str(via_set).splitlines()[-1] == refused(sent).splitlines()[-1] + " (from --set)"
    assert refused(sent).startswith("the params parameter (the run form): 1 problem")
    del sent["pretrain"]["lrr"]
    sent["pretrain"]["lr"] = 0
    assert "pretrain.lr" in refused(sent) and "must be > 0" in refused(sent)

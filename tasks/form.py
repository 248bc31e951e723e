"""The configuration as a typed Prefect parameter: the form the Prefect UI renders.

A pydantic model is derived from the config's dataclasses (tasks/config.py, moe/<part>/config.py),
never written a second time: one nested model per section, each field with its type, its
default (the project's params.yaml, else the embedded default), its declared range or
pattern (`knob`) as JSON-schema constraints, its choices (`Literal`; the stages' pools are a
choice of the defined pools) and its description (the field's comment, `field_docs`).
Unknown keys are refused (`extra="forbid"`: the schema says `additionalProperties: false`).

The flows take it with `validate_parameters=False` and hand what arrives (the model, or the
JSON a deployment run carries) to `load_config`, so whatever the source (the form, a params
file, `--set`), a bad value is refused by one path with one message naming its key path.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from moe.config import field_docs
from tasks.config import Config
from tasks.pools import STAGES, PoolsConfig, PoolSpec

StageName = Literal[STAGES]  # type: ignore[valid-type]  # the stage names, in order


def _title(path: str) -> str:
    return "".join(w.capitalize() for w in path.replace(".", "_").split("_"))


def _constraints(f: dataclasses.Field) -> dict[str, Any]:
    if "pattern" in f.metadata:  # `knob` patterns match the whole value
        return {"pattern": f"^(?:{f.metadata['pattern']})$"}
    ge, gt, le, lt = f.metadata.get("bounds", (None, None, None, None))
    return {k: v for k, v in {"ge": ge, "gt": gt, "le": le, "lt": lt}.items() if v is not None}


def section_model(cls: type, value: Any, path: str) -> type[BaseModel]:
    """The pydantic model of one config section (a dataclass) with `value`'s values as
    defaults; `path` is its key path (model names: one per path, since finetune_sql and
    finetune_domain share a class but not their defaults)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp, current = hints[f.name], getattr(value, f.name)
        here = f"{path}.{f.name}" if path else f.name
        info = {"description": docs.get(f.name) or None, **_constraints(f)}
        if dataclasses.is_dataclass(tp):
            sub = section_model(tp, current, here)
            fields[f.name] = (sub, Field(default_factory=sub, **info))
        elif cls is PoolsConfig and f.name == "definitions":
            pool = section_model(PoolSpec, PoolSpec(), f"{here}.pool")
            default = {k: pool(**dataclasses.asdict(v)) for k, v in current.items()}
            fields[f.name] = (dict[str, pool], Field(default=default, **info))
        elif cls is PoolsConfig and f.name == "stages":
            # "auto": the cheapest pool that holds the stage (tasks/fit.py)
            pools = Literal[(*value.definitions, "auto")]  # type: ignore[valid-type]
            stage_docs = {s: f"the pool {s} runs on (auto: the cheapest that fits)" for s in STAGES}
            stages = create_model(
                _title(here),
                __config__=ConfigDict(extra="forbid"),
                **{
                    s: (pools, Field(default=current[s], description=stage_docs[s])) for s in STAGES
                },
            )
            fields[f.name] = (stages, Field(default_factory=stages, **info))
        else:
            fields[f.name] = (tp, Field(default=current, **info))
    return create_model(
        _title(path) or "Params",
        __config__=ConfigDict(extra="forbid", title=path or "params"),
        __doc__=(cls.__doc__ or "").strip() or None,
        **fields,
    )


def config_model(cfg: Config) -> type[BaseModel]:
    """The whole configuration's model, with `cfg`'s values as the form's defaults."""
    return section_model(Config, cfg, "")


def as_params(value: Any) -> dict[str, Any] | None:
    """What a flow's `params` parameter carries, as load_config takes it: the form's model
    (a direct call) or the JSON of a deployment run, or None (use the params file)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value  # load_config names what it is instead of a mapping

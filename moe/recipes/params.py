"""The recipes' params tree: the library's sections composed (each declared beside its code,
moe/<part>/config.py), read from a params file and `--set` overrides, and checked.

`Params` is what a stage's training and evaluation read: data, tokenizer, model, moe, the
three training sections, evaluate and checkpoint. tasks/config.py `Config` extends it with
how the pipeline runs (storage, pools, cost, recovery, multi-node, W&B); a params file read
here keeps those sections for the orchestration to check and ignores them.

Reading is strict: a key given twice, YAML aliases, a file that is not UTF-8 text or not a
mapping are refused (ConfigError), every problem at once, each with its key path and line.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moe.adapters.config import LoraConfig
from moe.checkpoint.config import CheckpointConfig
from moe.config import FROM_SET, ConfigError, Problems, build, validate
from moe.data.config import DataConfig, TokenizerConfig
from moe.model.config import ModelConfig, MoEConfig
from moe.sql.config import EvaluateConfig
from moe.train.config import FinetuneConfig, OptimConfig, PretrainConfig

# The sections of the params file that say how the pipeline runs, not what it trains:
# tasks/config.py declares them (tests/test_recipes.py checks the two lists agree); the
# recipes leave them alone and refuse any other name they do not know.
ORCHESTRATION = ("storage", "pools", "cost", "recovery", "multinode", "wandb")

# Sections renamed since a release: a params file that still uses the old name is told what
# to rename (the check goes on under the new name, so every other problem is reported too).
RENAMED_SECTIONS = {"train": "pretrain"}


@dataclass
class Params:
    # The corpus and the SQL pair sets (prepare).
    data: DataConfig = field(default_factory=DataConfig)
    # The tokenizer prepare trains or reuses.
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # The architecture, or the Hugging Face model to start from.
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)  # Experts, routing and load balancing.
    # Pretraining: warm-up, then cosine decay to min_lr; validation and early stopping.
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    # Finetuning on the generic SQL pairs.
    finetune_sql: FinetuneConfig = field(default_factory=FinetuneConfig)
    # Finetuning on the target domain's pairs, a quarter of each batch's pairs the generic ones
    # (replay_pairs: over 3 seeds generic accuracy kept at 0.21, not lost to 0.00, and domain
    # accuracy 0.497 against 0.473: bench/RESULTS.md).
    finetune_domain: FinetuneConfig = field(
        default_factory=lambda: FinetuneConfig(
            max_steps=600,
            lr=2e-3,
            warmup_steps=5,
            checkpoint_every=50,
            replay_ratio=0.5,
            replay_pairs=0.25,
        )
    )
    # Evaluation, export and publication of the final model.
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # Tiered checkpoints.

    @classmethod
    @functools.cache
    def training_stages(cls) -> tuple[str, ...]:
        """The sections that train (an OptimConfig), in pipeline order."""
        hints = typing.get_type_hints(cls)
        return tuple(
            f.name
            for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], OptimConfig)
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self, *sections: str) -> str:
        """sha256 of the named sections (all when none), stable across key order."""
        d = self.to_dict()
        picked = {k: d[k] for k in (sections or d)}
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()

    def dump(self, path: Path) -> None:
        """Save the resolved configuration (beside every output)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def check_across(self, p: Problems) -> None:
        """What the sections must agree on with each other (after each section's own checks)."""
        for stage in self.training_stages():
            sec = getattr(self, stage)
            if isinstance(sec, FinetuneConfig):
                p.require(
                    sec.replay_ratio == 0
                    or sec.replay_split == "train"
                    or self.data.replay_fraction > 0,
                    f"{stage}.replay_ratio",
                    sec.replay_ratio,
                    "needs a replay split: set data.replay_fraction > 0, replay_split to train, "
                    "or replay_ratio to 0",
                )
                p.require(
                    # (outside 0..1 its range says what is wrong)
                    not 0 < sec.replay_pairs < 1 or stage != "finetune_sql",
                    f"{stage}.replay_pairs",
                    sec.replay_pairs,
                    "replays the pairs of the finetune stage before; finetune_sql has none:"
                    " set it to 0",
                )
                p.require(
                    not 0 < sec.replay_pairs < 1
                    or stage != "finetune_domain"
                    or sec.max_len >= self.finetune_sql.max_len,
                    f"{stage}.max_len",
                    sec.max_len,
                    f"must be >= finetune_sql.max_len ({self.finetune_sql.max_len}) with "
                    "replay_pairs: the replayed generic pairs were fitted to that length",
                )
                p.require(
                    sec.max_len <= self.model.seq_len,
                    f"{stage}.max_len",
                    sec.max_len,
                    f"must be <= model.seq_len ({self.model.seq_len})",
                )
            if sec.method != "full":
                self._check_adapted(stage, sec, p)

    def _check_adapted(self, stage: str, sec: OptimConfig, p: Problems) -> None:
        """LoRA and QLoRA adapt a model that exists: pretraining takes them only from
        model.init (continued pretraining), and they keep the experts as they are."""
        p.require(
            stage != "pretrain" or bool(self.model.init),
            f"{stage}.method",
            sec.method,
            "adapts a pretrained model: set model.init to one (continued pretraining), or "
            "train from scratch with method: full",
        )
        p.require(
            stage != "pretrain" or not self.moe.growth.enabled,
            f"{stage}.method",
            sec.method,
            "adapters keep the experts as they are: turn moe.growth.enabled off, or use full",
        )
        lora: LoraConfig = sec.lora
        t = lora.targets
        trains = t.attention or t.mlp or t.shared_expert or t.experts or lora.train_embeddings
        p.require(
            trains or lora.train_head or sec.router_policy() == "trained",
            f"{stage}.lora.targets",
            dataclasses.asdict(t),
            "nothing would train: turn a target on (or train_embeddings, train_head, router)",
        )


def build_params(
    cls: type[Params],
    raw: dict[str, Any],
    p: Problems,
    resolve: Callable[[Any, Problems], None] | None = None,
    across: bool = True,
) -> Any:
    """`cls` built from a nested mapping laid over its defaults (missing keys take them), a
    section under its old name renamed, and validated: every section's own checks, then
    those across sections. Problems go to `p`.

    `resolve` (moe/hf/model_init.py `resolve_init`) puts model.init's architecture in place
    of the model section's shape fields before the checks. A resolved configuration sent to
    another machine is not resolved again: that machine need not hold the imported folder.
    `across=False` leaves the checks across sections (`Params.check_across`) to the caller."""
    raw = _renamed(dict(raw), p)
    # Layer what the user wrote over the defaults, so that `--set pools.stages.pretrain=cpu`
    # changes one entry of a mapping instead of replacing the whole mapping.
    out = build(cls, deep_merge(cls().to_dict(), raw), p)
    if resolve is not None and out.model.init and not p.items:
        resolve(out, p)
    validate(out, p)
    if across:
        out.check_across(p)
    return out


def read_params(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    params: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, int], str]:
    """The raw mapping of a params file (or of `params`, a resolved configuration sent as a
    mapping), `--set` overrides applied; each key path's line; where it came from."""
    raw: dict[str, Any] = {}
    lines: dict[str, int] = {}
    source = "embedded default"
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(
                [f"params must be a mapping of sections, got {type(params).__name__}"],
                "the params parameter (the run form)",
            )
        raw, source, path = copy.deepcopy(params), "the params parameter (the run form)", None
    elif path is None and Path("params.yaml").is_file():
        path = "params.yaml"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(
                [
                    f"file not found: {path} (give an existing params file, or none for the "
                    "embedded default)"
                ],
                source,
            )
        loaded, text = _read_yaml(path, source)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                [f"the top level must be a mapping of sections, got {type(loaded).__name__}"],
                source,
            )
        raw, lines = loaded, _yaml_lines(text)
    for item in overrides:
        keys, value = parse_override(item)
        _apply_override(raw, keys, value)
        lines[".".join(keys)] = FROM_SET
    return raw, lines, source


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, stricter where a params file can go wrong silently or hang:
    a key given twice in one mapping is an error naming both lines (PyYAML keeps the last),
    and anchors/aliases are refused at the first alias (a few lines of nested aliases expand
    exponentially: the "billion laughs")."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"alias *{event.anchor} is not allowed in a params file: write the value out "
                "in full (anchors and aliases are refused, they can expand without bound)",
                event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice in one mapping (lines {seen[key]} and {line}): "
                    "keep one",
                    key_node.start_mark,
                )
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path, source: str) -> tuple[Any, str]:
    """The parsed file and its text; every way a file can be unreadable is a ConfigError."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError([f"cannot read the file: {e.strerror or e}"], source) from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            [
                f"not UTF-8 text: byte 0x{data[e.start]:02x} at line {line} (byte offset "
                f"{e.start}); save the file as UTF-8"
            ],
            source,
        ) from e
    try:
        return yaml.load(text, Loader=_StrictLoader), text  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        where = str(e).replace('"<unicode string>"', str(path))
        raise ConfigError([f"not valid YAML: {where}"], source) from e


def _yaml_lines(text: str) -> dict[str, int]:
    """Map each dotted key path of a YAML mapping to its 1-based line number."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                path = f"{prefix}.{k.value}" if prefix else str(k.value)
                lines[path] = k.start_mark.line + 1
                walk(v, path)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, "")
    return lines


def parse_override(item: str) -> tuple[list[str], Any]:
    """`pretrain.lr=3e-4` -> (["pretrain", "lr"], 3e-4). The value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(
            [f"--set {item!r}: expected KEY=VALUE, e.g. --set pretrain.lr=3e-4"], "--set"
        )
    key, _, text = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(
            [f"--set {item!r}: the key must be a dotted path like pretrain.lr"], "--set"
        )
    try:
        value = yaml.load(text, Loader=_StrictLoader) if text.strip() else ""  # noqa: S506
    except yaml.YAMLError as e:
        raise ConfigError([f"--set {item!r}: the value is not valid YAML ({e})"], "--set") from e
    return key.split("."), value


def _apply_override(raw: dict[str, Any], path: list[str], value: Any) -> None:
    node = raw
    for part in path[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[path[-1]] = value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`, mapping by mapping."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _renamed(raw: dict[str, Any], p: Problems) -> dict[str, Any]:
    """A section under its old name is a problem that says what to rename; its values are
    checked under the new name (with their lines), so nothing else goes unreported."""
    for old, new in RENAMED_SECTIONS.items():
        if old not in raw:
            continue
        # The key to name: the section's own line in a file, else the first --set under it.
        under = [k for k in p.lines if k.startswith(f"{old}.")]
        p.note(
            old if old in p.lines or not under else under[0],
            f"this section is now named {new}, after its stage: rename `{old}:` to `{new}:` "
            f"(and --set {old}.KEY to --set {new}.KEY)",
        )
        section = raw.pop(old)
        # Beside a section under the new name (a --set train.X on today's params.yaml), the
        # old one's values are laid over it, as the user meant them.
        raw[new] = deep_merge(raw[new], section) if isinstance(raw.get(new), dict) else section
        for k in [k for k in p.lines if k == old or k.startswith(f"{old}.")]:
            p.lines[new + k[len(old) :]] = p.lines[k]
    return raw

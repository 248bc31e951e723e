"""The pipeline's configuration: `params.yaml` (or flow parameters) + `--set` -> `Config`.

`Config` holds every section. The library's (data, tokenizer, model, moe, pretrain,
finetune_sql, finetune_domain, evaluate, checkpoint) are declared in moe/config.py beside the
code they configure; the orchestration's are declared here: where data and checkpoints are
stored, the machine pools and which stage runs on which, cost rates and the budget,
recovery of lost machines, multi-node launches and W&B. So is the stage list.

One source of every knob: the dataclass defaults are the embedded default and `params.yaml`
repeats them so that DVC tracks each key. Unknown keys, wrong types and invalid values are
collected and reported together (ConfigError), each with its key path, the offending value,
what is allowed and the file line; a key given twice and YAML aliases are refused.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moe.checkpoint.config import CheckpointConfig
from moe.config import FROM_SET, ConfigError, Problems, build, knob, validate
from moe.data.config import DataConfig, TokenizerConfig
from moe.errors import InputError
from moe.model.config import ModelConfig, MoEConfig
from moe.sql.config import EvaluateConfig
from moe.train.config import FinetuneConfig, OptimConfig, PretrainConfig
from tasks import fit

# The stages in pipeline order, each with the pool it runs on by default: preparing and
# publishing data on a cheap CPU box, pretraining on the fastest GPU (the most FLOPs), the
# finetunes on cheaper GPUs as the work shrinks (docs/DESIGN.md, "Stages and pools").
# flows/stages.py declares each stage's work and refuses to load while it disagrees.
DEFAULT_STAGE_POOLS: dict[str, str] = {
    "prepare": "cpu",
    "publish": "cpu",
    "pretrain": "gpu-h100",
    "finetune_sql": "gpu-a100",
    "finetune_domain": "gpu-4090",
    "evaluate": "gpu-4090",
}
STAGES: tuple[str, ...] = tuple(DEFAULT_STAGE_POOLS)

# Sections renamed since a release: a params file that still uses the old name is told what
# to rename (the check goes on under the new name, so every other problem is reported too).
RENAMED_SECTIONS = {"train": "pretrain"}


@dataclass
class StorageConfig:
    # Where data and models are published: a local folder, S3 or the Hugging Face Hub.
    backend: Literal["local", "s3", "hf"] = "local"
    root: str = "store"  # local backend: the object store folder
    bucket: str = ""  # s3 backend
    prefix: str = "moe-pipeline"  # key prefix of everything this project writes in the store
    endpoint_url: str = ""  # s3 backend: e.g. a MinIO or moto server; empty = AWS
    region: str = "us-east-1"  # S3 region
    hf_repo: str = ""  # hf backend: a dataset repo id, e.g. "me/moe-data" (token from HF_TOKEN)
    hf_revision: str = ""  # hf backend: branch to publish to (empty = main)
    dataset_name: str = "stdlib-code"  # the published dataset's name (its versions live under it)
    model_name: str = "moe-sql"  # the exported model is published under this name
    # hf backend: a *model* repo (owner/name) the exported model goes to, files at its root
    # (empty = under models/ in storage.hf_repo)
    hf_model_repo: str = ""
    zstd_level: int = knob(10, ge=1, le=22)  # compression level of the published archive
    zstd_threads: int = knob(-1, ge=-1)  # -1 = all cores
    cache_dir: str = ".cache/datasets"  # where training stages download published data
    # s3 backend: files above this size move in parts of this size, several at once (S3's
    # smallest part is 5 MiB; a failed part is sent again, not the whole file)
    multipart_mib: int = knob(64, ge=5, le=5120, note=" (S3's smallest and largest part, MiB)")

    def check(self, p: Problems) -> None:
        if self.backend == "s3":
            p.require(
                len(self.bucket) >= 3,
                "bucket",
                self.bucket,
                "the s3 backend needs a bucket name (3+ characters)",
            )
        if self.backend == "hf":
            p.require(
                self.hf_repo.count("/") == 1 and all(self.hf_repo.split("/")),
                "hf_repo",
                self.hf_repo,
                "the hf backend needs a dataset repo id like owner/name",
            )
        p.require(
            bool(self.model_name) and "/" not in self.model_name,
            "model_name",
            self.model_name,
            "must be a non-empty name without '/'",
        )
        if self.hf_model_repo:
            p.require(
                self.hf_model_repo.count("/") == 1 and all(self.hf_model_repo.split("/")),
                "hf_model_repo",
                self.hf_model_repo,
                "must be a model repo id like owner/name",
            )
        p.require(
            bool(self.dataset_name) and "/" not in self.dataset_name,
            "dataset_name",
            self.dataset_name,
            "must be a non-empty name without '/'",
        )


@dataclass
class PoolSpec:
    price_per_hour: float = knob(0.0, ge=0)  # USD per hour of one on-demand machine of this pool
    gpu: str = ""  # e.g. "H100"; empty = CPU only
    # The Prefect work pool's worker type.
    type: Literal["process", "docker", "kubernetes"] = "process"
    # Spot / preemptible machines: cheaper, and they vanish. `pricing` says which the pool
    # rents (the bill uses that price); the mean time between interruptions drives
    # checkpoint.every: auto (0 = none expected, as on-demand machines are priced here).
    pricing: Literal["on_demand", "spot"] = "on_demand"
    spot_price_per_hour: float = knob(0.0, ge=0)  # USD per hour of one spot machine
    # Mean hours between spot interruptions (checkpoint.every: auto).
    mean_hours_between_interruptions: float = knob(
        0.0, ge=0, note=" (0 = no interruptions expected)"
    )
    # One machine of the pool, as its job template requests it (flows/pools.py renders the
    # Docker and Kubernetes templates with these): GPUs, CPUs, memory, shared memory for
    # torch's data and NCCL, the GPU product label Kubernetes selects nodes by, the image.
    gpus: int = knob(0, ge=0)  # GPUs of one machine
    # Memory of one of its GPUs (what a stage's weights, trainable state and activations must
    # fit: bench/lora.py projects them per method); 0 = not declared.
    gpu_memory_gib: float = knob(0.0, ge=0, note=" (0 = not declared)")
    cpu: float = knob(4.0, gt=0)  # CPUs of one machine
    memory_gib: int = knob(16, ge=1)  # memory of one machine
    shm_gib: int = 2  # shared memory (/dev/shm) of one machine
    gpu_product: str = ""  # e.g. NVIDIA-H100-80GB-HBM3 (label nvidia.com/gpu.product)
    image: str = ""  # "" = moe-pipeline:gpu for a GPU pool, moe-pipeline:cpu otherwise

    @property
    def rate(self) -> float:
        """What one hour of this pool costs as rented (spot or on-demand)."""
        return self.spot_price_per_hour if self.pricing == "spot" else self.price_per_hour

    @property
    def mtbi_s(self) -> float:
        return self.mean_hours_between_interruptions * 3600

    def check(self, p: Problems) -> None:
        p.require(
            self.pricing != "spot" or self.spot_price_per_hour > 0,
            "spot_price_per_hour",
            self.spot_price_per_hour,
            "must be set (> 0) when pricing is spot",
        )
        p.require(
            (self.gpus > 0) == bool(self.gpu),
            "gpus",
            self.gpus,
            f"must be > 0 exactly when gpu is set (gpu: {self.gpu!r})",
        )
        p.require(
            0 < self.shm_gib < self.memory_gib,
            "shm_gib",
            self.shm_gib,
            f"must be > 0 and below memory_gib ({self.memory_gib}): /dev/shm counts against it",
        )


def _default_pools() -> dict[str, PoolSpec]:
    # Prices: Modal-style serverless rates (A100 $1.10/h, H100 $3.20/h); a cheap CPU box and a
    # community RTX 4090 at typical rental prices. Spot prices: roughly 40% below on-demand,
    # a typical discount (they move with the market: set yours). Every pool rents on-demand
    # by default and declares no interruptions; a spot pool sets pricing: spot and its
    # mean_hours_between_interruptions (what your provider's interruption history says).
    # Machines: one GPU each (pretrain.nproc 1), the CPUs and memory a one-GPU slice of such a
    # node typically has.
    def gpu(
        price: float, name: str, spot: float, product: str, cpu: float, mem: int, vram: float
    ) -> PoolSpec:
        return PoolSpec(
            price_per_hour=price,
            gpu=name,
            spot_price_per_hour=spot,
            gpus=1,
            gpu_memory_gib=vram,
            cpu=float(cpu),
            memory_gib=mem,
            shm_gib=8,
            gpu_product=product,
        )

    return {
        "cpu": PoolSpec(price_per_hour=0.10, spot_price_per_hour=0.04),
        "gpu-4090": gpu(0.45, "RTX 4090", 0.27, "NVIDIA-GeForce-RTX-4090", 8, 32, 24),
        "gpu-a100": gpu(1.10, "A100", 0.66, "NVIDIA-A100-SXM4-80GB", 12, 96, 80),
        "gpu-h100": gpu(3.20, "H100", 1.92, "NVIDIA-H100-80GB-HBM3", 16, 128, 80),
    }


@dataclass
class PoolsConfig:
    # The machine pools by name: price, GPUs and job template of each.
    definitions: dict[str, PoolSpec] = field(default_factory=_default_pools)
    # The pool each stage runs on.
    stages: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_STAGE_POOLS))

    def check(self, p: Problems) -> None:
        for stage, pool in self.stages.items():
            p.require(
                stage in STAGES,
                f"stages.{stage}",
                stage,
                f"is not a stage; stages are {', '.join(STAGES)}",
            )
            p.require(
                pool in self.definitions or pool == "auto",
                f"stages.{stage}",
                pool,
                f"is not a pool defined under pools.definitions ({', '.join(sorted(self.definitions))})"
                " nor auto",
            )
        missing = [s for s in STAGES if s not in self.stages]
        p.require(
            not missing,
            "stages",
            sorted(self.stages),
            f"must name a pool for every stage; missing: {', '.join(missing)}",
        )


@dataclass
class CostConfig:
    currency: str = "USD"  # the currency of every price
    budget: float = knob(
        5.0, ge=0, note=" (0 = no budget)"
    )  # for the whole pipeline; 0 = no budget
    alert_fraction: float = knob(
        0.8, gt=0, le=1
    )  # warn when spend passes this fraction of the budget
    storage_per_gb_month: float = knob(0.023, ge=0)  # object storage price (S3 standard)
    egress_per_gb: float = knob(0.09, ge=0)  # price of data leaving the store


@dataclass
class MultinodeConfig:
    """How a stage with `nodes` > 1 runs on a Kubernetes cluster (tasks/multinode.py): an
    Indexed Job of `nodes` pods of the stage's pool, a headless Service that gives pod 0 a
    name, and torchrun's c10d rendezvous at that name."""

    # Kubernetes namespace of the multi-node Jobs.
    namespace: str = knob(
        "moe-pipeline",
        pattern=r"[a-z0-9]([-a-z0-9]*[a-z0-9])?",
        note="a Kubernetes name (lower-case letters, digits, '-')",
    )
    service_account: str = ""  # "" = the namespace's default
    # A Kubernetes Secret whose keys become every pod's environment: the object store's
    # credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, HF_TOKEN, WANDB_API_KEY).
    credentials_secret: str = "moe-credentials"
    # Kubernetes secrets the nodes pull their image with.
    image_pull_secrets: list[str] = field(default_factory=list)
    rdzv_port: int = knob(29400, ge=1024, le=65535)  # the port of the nodes' rendezvous on node 0
    # How long the pods wait for each other at the rendezvous (nodes are scheduled and pull
    # the image at different times), and the Job's whole deadline (0 = none).
    join_timeout_s: int = knob(900, ge=30)
    # Seconds a multi-node Job may run in all (0 = no limit).
    deadline_s: int = knob(0, ge=0, note=" (0 = none)")
    poll_s: float = knob(10.0, gt=0)  # how often the flow run reads the Job's status


@dataclass
class RecoveryConfig:
    """Automatic recovery of a stage whose machine vanished (flows/recovery.py): Prefect
    automations that `stack up` creates (and infra/README.md shows for any server)."""

    enabled: bool = True  # create the Prefect automations that recover a lost stage
    # Flow runs send a heartbeat this often (Prefect's PREFECT_RUNNER_HEARTBEAT_FREQUENCY;
    # it accepts 30 s or more).
    heartbeat_s: int = knob(30, ge=30, note=" (Prefect's minimum)")
    # A run whose heartbeats stop is marked Crashed after this long. 90 s = three missed
    # heartbeats: one late heartbeat (a loaded API server, a long GC pause) never crashes a
    # live run, and the detection costs at most 1.5 minutes of an idle replacement.
    crashed_after_s: int = 90
    # Give up (a human looks) after this many recoveries of one stage in one pipeline run,
    # or this many recoveries in a row that got no further than the attempt before (a crash
    # loop, not preemption: bad data, an out-of-memory model).
    max_attempts: int = knob(20, ge=1)
    # Give up after this many recoveries in a row that got no further.
    max_stalled: int = knob(3, ge=1)
    # Wait before a recovery run starts: backoff_s, doubled for every stalled attempt in a
    # row (a pool short of machines is not hammered), at most backoff_max_s.
    backoff_s: float = knob(10.0, ge=0)
    backoff_max_s: float = 600.0  # the longest wait before a recovery run

    def check(self, p: Problems) -> None:
        p.require(
            self.crashed_after_s >= 2 * self.heartbeat_s,
            "crashed_after_s",
            self.crashed_after_s,
            f"must be at least twice heartbeat_s ({self.heartbeat_s}): with less, one late "
            "heartbeat would crash a live run",
        )
        p.require(
            self.backoff_max_s >= self.backoff_s,
            "backoff_max_s",
            self.backoff_max_s,
            "must be >= backoff_s",
        )


@dataclass
class WandbConfig:
    # Weights & Biases: offline files, online, or off.
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "moe-pipeline"  # W&B project
    entity: str = ""  # W&B team or user ("" = your default)
    dir: str = "wandb"  # where W&B writes its files

    def check(self, p: Problems) -> None:
        p.require(bool(self.project), "project", self.project, "must not be empty")


@dataclass
class Config:
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
    # Finetuning on the target domain's pairs.
    finetune_domain: FinetuneConfig = field(
        default_factory=lambda: FinetuneConfig(
            max_steps=600, lr=2e-3, warmup_steps=5, checkpoint_every=50, replay_ratio=0.5
        )
    )
    # Evaluation, export and publication of the final model.
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # Tiered checkpoints.
    # The object store between stages and machines.
    storage: StorageConfig = field(default_factory=StorageConfig)
    # Machine pools, their prices, and which stage runs where.
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    cost: CostConfig = field(default_factory=CostConfig)  # The bill and the budget.
    # Recovery of a stage whose machine vanished.
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    # Stages that span machines (Kubernetes Jobs).
    multinode: MultinodeConfig = field(default_factory=MultinodeConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases tracking.

    @staticmethod
    @functools.cache
    def training_stages() -> tuple[str, ...]:
        """The stages that train: those whose section is an OptimConfig, in pipeline order."""
        hints = typing.get_type_hints(Config)
        return tuple(s for s in STAGES if s in hints and issubclass(hints[s], OptimConfig))

    def pool_of(self, stage: str) -> tuple[str, PoolSpec | None]:
        """The pool (name, spec) a stage runs on (None if undefined)."""
        name = self.pools.stages.get(stage, "")
        return name, self.pools.definitions.get(name)

    def processes(self, stage: str) -> int:
        """The process count of a training stage on one machine: its nproc, or with nproc 0
        one per GPU of its pool (at least one)."""
        n = getattr(self, stage).nproc
        if n:
            return n
        pool = self.pool_of(stage)[1]
        return max(1, pool.gpus if pool else 0)

    def machines(self, stage: str) -> int:
        """Machines a stage rents at once: a training stage's nodes, else one."""
        return getattr(self, stage).nodes if stage in self.training_stages() else 1

    def world(self, stage: str) -> int:
        """Training processes of a stage over all its machines: nodes x processes."""
        return getattr(self, stage).nodes * self.processes(stage)

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


# --------------------------------------------------------------------------- loading


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


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def from_dict(
    raw: dict[str, Any],
    lines: dict[str, int] | None = None,
    source: str = "params",
    resolve_init: bool = True,
    check_fit: bool = True,
) -> Config:
    """Build and validate a Config from a nested mapping (missing keys take their defaults):
    every section's own checks, then those across sections; every problem at once.

    With model.init set (and `resolve_init`), the model's architecture replaces the model
    section's shape fields and its tokenizer becomes tokenizer.path (moe/hf/model_init.py
    `init_architecture`). A resolved configuration sent to another machine is not resolved
    again: that machine need not hold the imported folder."""
    p = Problems(lines, source)
    raw = _renamed(dict(raw), p)
    # Layer what the user wrote over the defaults, so that `--set pools.stages.pretrain=cpu`
    # changes one entry of a mapping instead of replacing the whole mapping.
    cfg = build(Config, _deep_merge(Config().to_dict(), raw), p)
    if resolve_init and cfg.model.init and not p.items:
        from moe.hf.model_init import init_architecture

        try:
            cfg.model, cfg.moe = init_architecture(cfg.model, cfg.moe)
            if not cfg.tokenizer.path:
                cfg.tokenizer.path = str(Path(cfg.model.init) / "tokenizer.json")
        except InputError as e:
            p.add("model.init", cfg.model.init, str(e))
    validate(cfg, p)
    shapes_valid = not p.items  # the model can be built (on the meta device) to measure
    if shapes_valid:
        _resolve_auto_pools(cfg, p)
    for stage in cfg.training_stages():
        _check_training_stage(cfg, stage, p)
        if shapes_valid and check_fit:
            _check_fit(cfg, stage, p)
    if cfg.moe.growth.enabled:
        p.require(
            cfg.world("pretrain") == 1,
            "moe.growth.enabled",
            True,
            "expert growth runs in one process: set pretrain.nproc and pretrain.nodes to 1 or "
            "growth off",
        )
    if p.items:
        raise ConfigError(p.items, source)
    return cfg


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
        raw[new] = _deep_merge(raw[new], section) if isinstance(raw.get(new), dict) else section
        for k in [k for k in p.lines if k == old or k.startswith(f"{old}.")]:
            p.lines[new + k[len(old) :]] = p.lines[k]
    return raw


def _check_training_stage(cfg: Config, stage: str, p: Problems) -> None:
    """What a training stage's section must agree on with the model, the data, its pool and
    the store: its processes split the experts and the batch, its machines reach the store."""
    sec = getattr(cfg, stage)
    if isinstance(sec, FinetuneConfig):
        p.require(
            sec.replay_ratio == 0 or sec.replay_split == "train" or cfg.data.replay_fraction > 0,
            f"{stage}.replay_ratio",
            sec.replay_ratio,
            "needs a replay split: set data.replay_fraction > 0, replay_split to train, or "
            "replay_ratio to 0",
        )
        p.require(
            sec.max_len <= cfg.model.seq_len,
            f"{stage}.max_len",
            sec.max_len,
            f"must be <= model.seq_len ({cfg.model.seq_len})",
        )
    _check_method(cfg, stage, sec, p)
    if sec.nodes < 1 or sec.nproc < 0:
        return  # refused by the section's own ranges; the splits below need a count
    n = cfg.processes(stage)
    what = f"{n} (one per GPU of its pool)" if sec.nproc == 0 else f"{n}"
    if sec.nodes > 1:
        what = f"{sec.nodes * n} ({sec.nodes} nodes x {n})"
    pool_name, pool = cfg.pool_of(stage)
    world = sec.nodes * n
    if sec.expert_parallel:
        p.require(
            world % sec.expert_parallel == 0,
            f"{stage}.expert_parallel",
            sec.expert_parallel,
            f"must divide the process count ({what}): the experts are split over groups of "
            "this many processes (0 = all of them)",
        )
        p.require(
            cfg.moe.num_experts % sec.expert_parallel == 0,
            f"{stage}.expert_parallel",
            sec.expert_parallel,
            f"must divide moe.num_experts ({cfg.moe.num_experts}): each process of a group "
            "holds an equal share of the experts",
        )
    else:
        p.require(
            cfg.moe.num_experts % world == 0,
            f"{stage}.nproc",
            what,
            f"must divide moe.num_experts ({cfg.moe.num_experts}): each process holds an equal "
            f"share of the experts (or set {stage}.expert_parallel to a divisor of both)",
        )
    p.require(
        sec.batch_size % (sec.nodes * n) == 0,
        f"{stage}.batch_size",
        sec.batch_size,
        f"must be a multiple of the process count ({what}): each process takes an equal share",
    )
    p.require(
        sec.nodes == 1 or cfg.storage.backend != "local",
        f"{stage}.nodes",
        sec.nodes,
        f"needs an object store every node reaches (storage.backend s3 or hf, not "
        f"{cfg.storage.backend!r}): data, the start model and checkpoints travel through it",
    )
    # One process per GPU: more processes than the pool's machine has GPUs would share
    # them (or fail to start); a CPU run (device: cpu) may use any count.
    p.require(
        pool is None or sec.device == "cpu" or pool.gpus == 0 or n <= pool.gpus,
        f"{stage}.nproc",
        sec.nproc,
        f"is more than the {pool.gpus if pool else 0} GPU(s) its pool {pool_name} gives "
        f"(pools.definitions.{pool_name}.gpus): raise that, or lower nproc (processes "
        f"on the CPU: set {stage}.device to cpu)",
    )


def _resolve_auto_pools(cfg: Config, p: Problems) -> None:
    """`pools.stages.<stage>: auto`: a training stage gets the cheapest defined pool whose
    GPUs hold its weights and trainable state as configured (tasks/fit.py); another stage the
    cheapest pool."""
    pools = cfg.pools.definitions
    for stage, pool in list(cfg.pools.stages.items()):
        if pool != "auto" or not pools:
            continue
        if stage not in cfg.training_stages() or getattr(cfg, stage).device == "cpu":
            cfg.pools.stages[stage] = min(pools, key=lambda n: (pools[n].rate, n))
            continue
        sec = getattr(cfg, stage)
        vocab = fit.model_vocab(cfg.model, cfg.tokenizer.vocab_size)
        state = fit.needs(cfg.model, cfg.moe, vocab, sec)
        best = fit.cheapest(fit.pool_fits(state, sec, pools))
        if best is None:
            p.add(
                f"pools.stages.{stage}",
                pool,
                f"no defined pool's GPUs hold {stage}'s {state.total / 1e9:.1f} GB of weights "
                f"and trainable state ({sec.method}) with its activations: define a larger "
                f"pool, raise {stage}.nodes, lower {stage}.batch_size, or use lora or qlora",
            )
        else:
            cfg.pools.stages[stage] = best.pool


def _check_fit(cfg: Config, stage: str, p: Problems) -> None:
    """A stage whose weights and trainable state its pool's GPUs cannot hold is refused
    before any machine is used, naming the pools and methods that would (tasks/fit.py)."""
    pool = cfg.pools.stages.get(stage, "")
    if stage == "pretrain" and cfg.model.init and cfg.model.init_pretrain == "skip":
        return  # the imported model passes through untrained
    if pool in cfg.pools.definitions:
        vocab = fit.model_vocab(cfg.model, cfg.tokenizer.vocab_size)
        sec = getattr(cfg, stage)
        why = fit.refusal(stage, cfg.model, cfg.moe, vocab, sec, pool, cfg.pools.definitions)
        if why:
            p.add(f"pools.stages.{stage}", pool, why)


def _check_method(cfg: Config, stage: str, sec: Any, p: Problems) -> None:
    """LoRA and QLoRA adapt a model that exists: pretraining takes them only from model.init
    (continued pretraining); QLoRA runs in one process (its NF4 base is not sharded)."""
    if sec.method == "full":
        return
    p.require(
        stage != "pretrain" or bool(cfg.model.init),
        f"{stage}.method",
        sec.method,
        "adapts a pretrained model: set model.init to one (continued pretraining), or "
        "train from scratch with method: full",
    )
    p.require(
        stage != "pretrain" or not cfg.moe.growth.enabled,
        f"{stage}.method",
        sec.method,
        "adapters keep the experts as they are: turn moe.growth.enabled off, or use full",
    )
    t = sec.lora.targets
    trains = t.attention or t.mlp or t.shared_expert or t.experts or sec.lora.train_embeddings
    p.require(
        trains or sec.lora.train_head or sec.router_policy() == "trained",
        f"{stage}.lora.targets",
        dataclasses.asdict(t),
        "nothing would train: turn a target on (or train_embeddings, train_head, router)",
    )
    p.require(
        sec.method != "qlora" or cfg.world(stage) == 1,
        f"{stage}.method",
        sec.method,
        "runs in one process (the NF4 base is not sharded): set nproc 1 and nodes 1, or use "
        "lora (sharded with FSDP2 + EP)",
    )


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    params: dict[str, Any] | None = None,
    check_fit: bool = True,
) -> Config:
    """Load `path` (default: ./params.yaml if it exists, else the embedded default) + overrides.
    `check_fit=False` (`moe-pipeline plan`) leaves out the check that each training stage
    fits its pool's GPUs, so that the plan can show what does.

    `params` (a resolved configuration as a mapping, e.g. a flow parameter sent by the
    pipeline to a stage on another machine) takes the place of the file.
    Raises ConfigError naming every bad key; touches nothing on disk.
    """
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
                    f"file not found: {path} (give an existing params file, or none for the embedded default)"
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
    return from_dict(raw, lines, source, resolve_init=params is None, check_fit=check_fit)


def default_yaml() -> str:
    """The embedded default as YAML (what `params.yaml` ships with)."""
    return yaml.safe_dump(Config().to_dict(), sort_keys=False)

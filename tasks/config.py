"""The pipeline's configuration: `params.yaml` (or flow parameters) + `--set` -> `Config`.

`Config` is the recipes' params tree (moe/recipes/params.py: data, tokenizer, model, moe,
pretrain, finetune_sql, finetune_domain, evaluate, checkpoint, each section declared beside
the code it configures) with how the pipeline runs them, declared here: where data and
checkpoints are stored, cost rates and the budget, recovery of lost machines, multi-node
launches and W&B; the machine pools and the stage list are tasks/pools.py's.

One source of every knob: the dataclass defaults are the embedded default and `params.yaml`
repeats them so that DVC tracks each key. Unknown keys, wrong types and invalid values are
collected and reported together (ConfigError), each with its key path, the offending value,
what is allowed and the file line; a key given twice and YAML aliases are refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moe.config import ConfigError, Problems, knob
from moe.recipes.params import Params, build_params, read_params
from tasks import fit
from tasks.pools import PoolsConfig, PoolSpec


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
class Config(Params):
    """The recipes' sections (moe/recipes/params.py) and how the pipeline runs them."""

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


# --------------------------------------------------------------------------- loading


def from_dict(
    raw: dict[str, Any],
    lines: dict[str, int] | None = None,
    source: str = "params",
    resolve: bool = True,
    check_fit: bool = True,
) -> Config:
    """Build and validate a Config from a nested mapping (missing keys take their defaults):
    the recipes' sections and their checks (moe/recipes/params.py `build_params`), then what
    the stages need of their pools, machines and store; every problem at once."""
    p = Problems(lines, source)
    resolver = functools.partial(_resolve_init, tokenizer=check_fit)
    cfg = build_params(Config, raw, p, resolver if resolve else None, across=False)
    shapes_valid = not p.items  # the model can be built (on the meta device) to measure
    cfg.check_across(p)
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


def _resolve_init(params: Any, p: Problems, tokenizer: bool) -> None:
    from moe.hf.model_init import resolve_init  # torch: only where a model is imported

    resolve_init(params, p, tokenizer)


def _check_training_stage(cfg: Config, stage: str, p: Problems) -> None:
    """What a training stage's section must agree on with the model, the data, its pool and
    the store: its processes split the experts and the batch, its machines reach the store."""
    sec = getattr(cfg, stage)
    p.require(
        sec.method != "qlora" or cfg.world(stage) == 1,
        f"{stage}.method",
        sec.method,
        "runs in one process (the NF4 base is not sharded): set nproc 1 and nodes 1, or use "
        "lora (sharded with FSDP2 + EP)",
    )
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


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    params: dict[str, Any] | None = None,
    check_fit: bool = True,
) -> Config:
    """Load `path` (default: ./params.yaml if it exists, else the embedded default) + overrides.
    `check_fit=False` (`moe-pipeline plan`) leaves out the check that each training stage
    fits its pool's GPUs, so that the plan can show what does, and takes a model.init folder
    with its config.json alone (a plan before the weights are downloaded).

    `params` (a resolved configuration as a mapping, e.g. a flow parameter sent by the
    pipeline to a stage on another machine) takes the place of the file.
    Raises ConfigError naming every bad key; touches nothing on disk.
    """
    raw, lines, source = read_params(path, overrides, params)
    return from_dict(raw, lines, source, resolve=params is None, check_fit=check_fit)


def default_yaml() -> str:
    """The embedded default as YAML (what `params.yaml` ships with)."""
    return yaml.safe_dump(Config().to_dict(), sort_keys=False)

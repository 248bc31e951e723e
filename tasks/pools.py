"""The machine pools: what each pool's machines are (GPUs and their memory, CPUs, the image,
the hourly price, how often they are taken away) and which stage runs on which; and the
stages themselves, in pipeline order, each with its default pool. This table is the one list
of stages: the params check, the CLI, the run form, the deployments and flows/stages.py (each
stage's declaration, looked up by name) all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moe.config import Problems, knob

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

"""One work pool per entry of `pools.definitions`, each with a job template of its own.

A base job template (infra/pools/<type>.json) holds what every pool of that worker type
shares; `job_template()` fills in what one pool's machines are (`PoolSpec`: GPUs, CPUs,
memory, /dev/shm, the GPU product nodes are selected by, the image, a volume of its own), so
the cpu pool asks for no GPU and the H100 pool for its node type. `create()` makes or updates
the pools on a Prefect server with them: `moe-pipeline pools create --type kubernetes`.
Prefect reads a pool's variable defaults when a worker builds a flow run's job, so these
are the values that reach the Job or container (tests/test_pools.py builds them through
prefect-kubernetes' and prefect-docker's own job configurations).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

from tasks.cluster import pool_image as image
from tasks.config import Config

TEMPLATES = Path(__file__).resolve().parents[1] / "infra" / "pools"
Kind = Literal["process", "docker", "kubernetes"]


def job_template(cfg: Config, pool: str, kind: Kind, image_tag: str = "") -> dict[str, Any]:
    """The base job template of `pool` for a worker of type `kind`."""
    spec = cfg.pools.definitions[pool]
    t = json.loads((TEMPLATES / f"{kind}.json").read_text())
    props = t["variables"]["properties"]

    def default(name: str, value: Any) -> None:
        props[name]["default"] = copy.deepcopy(value)

    if kind == "kubernetes":
        default("image", image(spec, image_tag))
        default("gpus", spec.gpus)
        default("cpu", f"{spec.cpu:g}")
        default("memory", f"{spec.memory_gib}Gi")
        default("shm_size", f"{spec.shm_gib}Gi")
        default("node_selector", {"nvidia.com/gpu.product": spec.gpu_product} if spec.gpus else {})
        if not spec.gpus:
            default("tolerations", [])
        default("work_claim", f"moe-work-{pool}")  # runs of two pools never share a disk
    elif kind == "docker":
        default("image", image(spec, image_tag))
        requests = [{"Driver": "nvidia", "Count": spec.gpus, "Capabilities": [["gpu"]]}]
        default("device_requests", requests if spec.gpus else [])
        default("mem_limit", f"{spec.memory_gib}g")
        default("shm_size", f"{spec.shm_gib}g")
        default("volumes", [f"moe-work-{pool}:/app/models"])
    return t


def create(client: Any, cfg: Config, kind: Kind, image_tag: str = "") -> list[str]:
    """Create (or update) every pool of `pools.definitions` as a `kind` work pool with its
    own job template; returns their names."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists

    made = []
    for pool in sorted(cfg.pools.definitions):
        template = job_template(cfg, pool, kind, image_tag)
        try:
            client.create_work_pool(
                WorkPoolCreate(name=pool, type=kind, base_job_template=template)
            )
        except ObjectAlreadyExists:
            client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))
        made.append(pool)
    return made

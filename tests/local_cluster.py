"""A stand-in for a Kubernetes cluster (tasks/cluster.py), for tasks/multinode.py's launcher.

Kubernetes cannot run on this machine (no container image can be pulled), so this class
plays its API server and kubelet, and nothing more: it runs each pod of an Indexed Job as a
local process with what the manifest says, so the manifest is what gets tested:

- the container's command with its env (and the test's own environment in place of the
  credentials Secret that envFrom names), JOB_COMPLETION_INDEX set as Kubernetes sets it;
- its workingDir as a fresh empty folder per pod (each pod is a new machine with nothing on
  its disk), the ConfigMap's files in a folder in place of its mountPath;
- the DNS name `<job>-0.<service>` of pod 0 as 127.0.0.1 (the headless Service's job).

A Job fails as soon as any pod fails (backoffLimit 0), and the others are stopped then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tasks.cluster import JobState

_JOBS: dict[str, dict[str, Any]] = {}  # shared by every instance (open_cluster makes new ones)
_LOCK = threading.Lock()


class LocalCluster:
    created: list[dict[str, Any]] = []
    deleted: list[tuple[str, str]] = []

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="local-cluster-"))
        self.config_maps: dict[str, dict[str, str]] = {}

    def create(self, manifest: dict[str, Any]) -> None:
        LocalCluster.created.append(manifest)
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if kind == "ConfigMap":
            with _LOCK:
                _JOBS.setdefault(name, {})["config_map"] = manifest["data"]
        elif kind == "Job":
            self._start(manifest)

    def _start(self, job: dict[str, Any]) -> None:
        name, spec = job["metadata"]["name"], job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        with _LOCK:
            data = _JOBS.setdefault(name, {}).get("config_map")
        assert data is not None, "the ConfigMap must exist before the Job's pods start"
        mounts = {}
        for vm in container["volumeMounts"]:
            (vol,) = [v for v in pod["volumes"] if v["name"] == vm["name"]]
            if "configMap" in vol:
                folder = self.root / name / "configmap"
                folder.mkdir(parents=True, exist_ok=True)
                for fname, text in data.items():  # DNS: pod 0 of the Service is this host
                    (folder / fname).write_text(
                        text.replace(f"{name}-0.{pod['subdomain']}", "127.0.0.1")
                    )
                mounts[vm["mountPath"]] = str(folder)
        procs = []
        for index in range(spec["completions"]):
            cwd = self.root / name / f"pod-{index}"
            cwd.mkdir(parents=True)
            env = {**os.environ, "JOB_COMPLETION_INDEX": str(index), "OMP_NUM_THREADS": "1"}
            for e in container["env"]:
                value = e["value"]
                for path, folder in mounts.items():
                    value = value.replace(path, folder)
                env[e["name"]] = value
            cmd = [sys.executable if c == "python" else c for c in container["command"]]
            log = open(cwd / "pod.log", "w")  # noqa: SIM115 - closed when the pod ends
            procs.append(
                (
                    subprocess.Popen(
                        cmd,
                        cwd=cwd,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    log,
                )
            )
        with _LOCK:
            _JOBS[name].update(procs=procs, labels=job["metadata"]["labels"], failed=False)

    def job_state(self, namespace: str, name: str) -> JobState:
        with _LOCK:
            job = _JOBS[name]
        codes = [p.poll() for p, _ in job["procs"]]
        failed = sum(1 for c in codes if c not in (None, 0))
        if failed and not job["failed"]:  # backoffLimit 0: the Job fails, its pods stop
            job["failed"] = True
            for p, _ in job["procs"]:
                if p.poll() is None:
                    _signal(p, signal.SIGTERM)
        for p, log in job["procs"]:
            if p.poll() is not None:
                log.close()
        return JobState(
            active=sum(1 for c in codes if c is None),
            succeeded=sum(1 for c in codes if c == 0),
            failed=failed,
            complete=all(c == 0 for c in codes),
            reason="BackoffLimitExceeded: a pod failed" if job["failed"] else "",
            ready=sum(1 for c in codes if c is None),  # a process started is a pod running
        )

    def running_jobs(self, namespace: str, labels: dict[str, str]) -> list[str]:
        with _LOCK:
            jobs = dict(_JOBS)
        return [
            name
            for name, job in jobs.items()
            if "procs" in job
            and not job["failed"]
            and all(job["labels"].get(k) == v for k, v in labels.items())
            and any(p.poll() is None for p, _ in job["procs"])
        ]

    def delete(self, kind: str, namespace: str, name: str) -> None:
        LocalCluster.deleted.append((kind, name))
        if kind == "Job":
            for p, _ in _JOBS.get(name, {}).get("procs", []):
                if p.poll() is None:
                    _signal(p, signal.SIGKILL)
                    p.wait()

    # for tests: what a node's machine dying looks like
    def kill(self, name: str, index: int) -> None:
        p, _ = _JOBS[name]["procs"][index]
        _signal(p, signal.SIGKILL)  # the pod's processes all go: torchrun and its ranks

    def started(self, name: str) -> bool:
        """Whether the Job's pods have been started."""
        with _LOCK:
            return "procs" in _JOBS.get(name, {})

    def freeze(self, name: str, index: int, frozen: bool = True) -> None:
        """Stop (SIGSTOP) or continue a pod's processes: while one pod of a training Job is
        stopped, the others wait at its next collective, so a test can look without racing."""
        p, _ = _JOBS[name]["procs"][index]
        _signal(p, signal.SIGSTOP if frozen else signal.SIGCONT)

    def pod_dir(self, name: str, index: int) -> Path:
        return self.root / name / f"pod-{index}"


def reset() -> None:
    """Forget every Job and stop the pods a test left running: the class-level lists and
    the module's Jobs are per test, so tests pass alone and in any order in one process
    (tests/test_multinode.py runs this around each test)."""
    with _LOCK:
        jobs = list(_JOBS.values())
        _JOBS.clear()
    for job in jobs:
        for p, log in job.get("procs", []):
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
                p.wait()
            log.close()
    LocalCluster.created.clear()
    LocalCluster.deleted.clear()


def _signal(p: subprocess.Popen, sig: int) -> None:
    """Signal a pod: its whole process group (each pod is a session of its own)."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass

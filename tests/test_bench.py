"""The benchmarks that hold us against a peer run here at a tiny shape (a smoke run: the code
path and the report's fields, not a figure), so that a change that breaks one fails a test."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_gpu_peer_benchmark_runs_every_arm_on_the_cpu() -> None:
    """bench/gpu_peer.py at its tiny shape on the CPU: our three methods through the stage's
    training code and transformers + PEFT, each with a speed, the plan's figure, and no host
    sync in a steady step."""
    proc = subprocess.run(
        [sys.executable, "bench/gpu_peer.py", "--shape", "tiny", "--steps", "2", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu"
    for m in ("full", "lora", "qlora"):
        assert out[m]["tokens_per_s"] > 0 and out[m]["plan_gb"] > 0
        assert out[m]["host_syncs_per_step"] == 0, out[m]
        assert out[m]["speed_vs_peft"] > 0
    assert out["peft"]["tokens_per_s"] > 0

"""The benchmarks that hold us against a peer run here at a tiny shape (a smoke run: the code
path and the report's fields, not a figure), so that a change that breaks one fails a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _report(script: str, *args: str, **env: str) -> dict:
    """Run a benchmark in a process of its own; the JSON object it prints last."""
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
            **env,
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_gpu_peer_benchmark_runs_every_arm_on_the_cpu() -> None:
    """bench/gpu_peer.py at its tiny shape on the CPU: our three methods through the stage's
    training code and transformers + PEFT, each with a speed, the plan's figure, and no host
    sync in a steady step."""
    args = ("--shape", "tiny", "--steps", "2", "--rounds", "1")
    out = _report("gpu_peer.py", *args, HF_HUB_OFFLINE="1")
    assert out["device"] == "cpu"
    for m in ("full", "lora", "qlora"):
        assert out[m]["tokens_per_s"] > 0 and out[m]["plan_gb"] > 0
        assert out[m]["host_syncs_per_step"] == 0, out[m]
        assert out[m]["speed_vs_peft"] > 0
    assert out["peft"]["tokens_per_s"] > 0


BENCHMARKS = sorted(p.name for p in (ROOT / "bench").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_imports_and_parses_its_arguments(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A move of the code a benchmark imports breaks the benchmark here, not months later
    on the machine it was written for: each one imports and answers --help."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT))
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", ROOT / "bench" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "main"):  # a library of the others (bench/spider_corpus.py)
        return
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        module.main()
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_the_sharded_memory_benchmark_runs_without_the_history_of_old_modules() -> None:
    """bench/memory.py --quick measures against the analytic one-shard figure: it no longer
    needs `git show` of a module path a later move removed."""
    out = _report("memory.py", "--quick", "--steps", "2", "--rounds", "1", OMP_NUM_THREADS="1")
    assert out["one_shard"] == 0.5 and out["per_rank_state_ratio"] <= 0.6
    assert 0 < out["save_host_ratio"] < 1

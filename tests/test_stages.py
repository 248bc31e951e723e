"""The stage declarations (flows/stages.py): a stage added by a declaration and a body, and
wired where the checks say, runs through `dvc repro` and `moe-pipeline run` with the same
wrapper as every other stage (lineage record, skip when unchanged, the CLI's message)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moe.sql.config import EvaluateConfig
from tests.conftest import ROOT
from tests.test_e2e import _copy_repo

pytestmark = pytest.mark.slow

TOY = '''
def _toy(cfg: Config, record: StageRecord) -> Done:
    """A toy stage: writes a greeting."""
    out = REPORTS / "toy"
    out.mkdir(parents=True, exist_ok=True)
    (out / "hello.txt").write_text(f"hello from {cfg.evaluate.max_new_tokens}")
    return Done({"greeting": "hello"}, {"hello": out / "hello.txt"})


TOY = Stage(
    "toy",
    "evaluate",
    "A toy stage.",
    out=lambda cfg: REPORTS / "toy",
    inputs=lambda cfg: {},
    handoff=lambda cfg: [REPORTS / "toy" / "hello.txt"],
    body=_toy,
    done="reports/toy/hello.txt",
)

'''


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: the test's anchor {old!r} moved"
    path.write_text(text.replace(old, new, 1))


def _add_toy_stage(root: Path) -> None:
    """What adding a stage takes: its declaration and body (here in flows/stages.py itself),
    its name and default pool in the one stage list (tasks/pools.py), params and dvc.yaml."""
    stages = root / "flows/stages.py"
    _edit(stages, "\n# Each stage's declaration", TOY + "\n# Each stage's declaration")
    _edit(stages, "FINETUNE_DOMAIN, EVALUATE)", "FINETUNE_DOMAIN, EVALUATE, TOY)")
    _edit(
        root / "tasks/pools.py",
        '    "evaluate": "gpu-4090",\n',
        '    "evaluate": "gpu-4090",\n    "toy": "cpu",\n',
    )
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pools"]["stages"]["toy"] = "cpu"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc = yaml.safe_load((root / "dvc.yaml").read_text())
    dvc["stages"]["toy"] = {
        "cmd": "moe-pipeline stage toy",
        "params": ["evaluate.max_new_tokens"],
        "outs": ["reports/toy"],
    }
    (root / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))


def test_a_new_stage_is_a_declaration_and_a_body(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    root = tmp_path / "repo"
    _copy_repo(root)
    _add_toy_stage(root)
    env = {
        **os.environ,
        **prefect_server,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(root),  # the copy's code, not the editable install's
    }

    def run(*args: str) -> str:
        r = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{args}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout + r.stderr

    run("dvc", "repro", "toy")
    default = EvaluateConfig().max_new_tokens  # what the toy body writes when unset
    assert (root / "reports/toy/hello.txt").read_text() == f"hello from {default}"
    record = json.loads((root / "reports/toy/lineage.json").read_text())
    assert record["stage"] == "toy" and record["pool"] == "cpu" and record["flow_run_id"]
    assert "hello" in record["outputs"] and record["metrics"] == {"greeting": "hello"}
    assert "toy" in yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    # the same stage through the CLI: unchanged, so the wrapper skips it and says so
    out = run(sys.executable, "-m", "flows.cli", "run", "--stages", "toy")
    assert "stage toy skipped" in out and "toy done: reports/toy/hello.txt" in out
    # a param it reads changes: the stage runs again and writes the new value
    out = run(
        sys.executable, "-m", "flows.cli", "stage", "toy", "--set", "evaluate.max_new_tokens=7"
    )
    assert "toy done" in out and (root / "reports/toy/hello.txt").read_text() == "hello from 7"
    assert ROOT != root  # the repository itself was not touched


FRAGMENTED_STAGE = """
import json
from dataclasses import replace
from pathlib import Path
import flows.stages as fs

def rss_anon_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

seen, kept = {}, []

def body(cfg, record):
    # 4,096 blocks of 64 KiB (below glibc's mmap threshold: they live on the heap), written
    # so their pages are resident; every 16th is kept, so the freed ones sit between live
    # blocks and the heap's top cannot shrink by itself.
    blocks = [b"\\x01" * 65536 for _ in range(4096)]
    kept.extend(blocks[::16])
    del blocks
    seen["freed_in_body"] = rss_anon_mb()
    return fs.Done({"toy": 1}, {})

class Record(fs.StageRecord):  # the lineage record is written just after the hand-back
    def write(self, **kw):
        seen["at_record"] = rss_anon_mb()
        return super().write(**kw)

fs.StageRecord = Record
toy = replace(fs.STAGES_BY_NAME["evaluate"], body=body, out=lambda cfg: Path("toy"),
              inputs=lambda cfg: {})
fs.run_stage(toy)
print(json.dumps(seen))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; glibc's trim")
def test_a_stage_hands_its_freed_memory_back_before_the_next_stage(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """`moe-pipeline run` runs every stage in one process, and glibc keeps freed heap pages
    for reuse: without a hand-back the process holds most of a stage's peak while the next
    one starts (7.15 GB of 8.2 between SmolLM2's two finetune stages, bench/RESULTS.md). A
    stage whose body frees 240 MiB in pieces between live blocks: by the time run_stage
    writes its lineage record, that memory has left the process's resident set."""
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_STAGE],
        cwd=tmp_path, capture_output=True, text=True, check=True,
        env={**os.environ, **prefect_server, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["freed_in_body"] - seen["at_record"] > 200, seen  # of the 240 MiB freed
    assert (tmp_path / "toy" / "lineage.json").is_file()


FRAGMENTED_HEAP = """
import torch
from flows.stages import return_freed_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10

# Freeing a mapped 30 MiB block raises glibc's mmap threshold to it, so the 8 MiB tensors
# after it come from the heap; the last one, kept, holds the heap's top where it is.
block = torch.ones(30 << 20, dtype=torch.uint8)
del block
held = [torch.ones(8 << 20, dtype=torch.uint8) for _ in range(101)]
del held[:100]
freed = rss()
assert return_freed_memory()
print(freed - rss())
"""


def test_freed_heap_goes_back_to_the_system() -> None:
    """glibc keeps freed heap pages resident: `moe-pipeline run` hands them back after each
    stage (flows/stages.py return_freed_memory), 800 MiB of freed heap here. In a process of
    its own: pytest's heap is not a clean one."""
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_HEAP], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 600 << 20

"""Import, a few finetune steps and export of a Hugging Face MoE checkpoint (moe/hf/).

A Qwen3-MoE built by transformers itself (`from_config`, random weights, saved in bf16 with
`save_pretrained`, sharded) is imported, trained for a few AdamW steps and exported, each in
its own process so that its peak resident memory (VmHWM) is its own. Memory is reported
as (peak - the process's resident memory before it touched the weights) over the bytes of
the checkpoint's weights: an import that held the weights twice would show >= 2 there (the
model is built in the checkpoint's dtype on the meta device and filled tensor by tensor).
Then the logits of our model against transformers' on the same weights, in fp32 and in bf16
(each against the fp32 reference, and ours against theirs).

JSON last. Run: `.venv/bin/python bench/hf_import.py [--layers 8 --experts 16]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def anon_mb(pid: int | str = "self") -> float:
    """A process's RssAnon (its private resident memory) in MB; 0 when it has ended."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_mb() -> float:
    """Resident set size now (Linux /proc), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    """This process's own peak RSS since exec (VmHWM). Not ru_maxrss: Linux carries into it
    the RSS of the parent the child was forked from (here, the one that built the model)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class AnonPeak:
    """Samples RssAnon (private memory: what the weights cost, without the mapped file's
    pages, which the kernel reclaims) every 5 ms in a thread; `.peak` in MB."""

    def __init__(self) -> None:
        import threading

        self.peak, self.done = 0.0, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done:
            self.peak = max(self.peak, anon_mb())
            time.sleep(0.005)

    def stop(self) -> float:
        self.done = True
        self.thread.join()
        return self.peak


def child(kind: str, src: str, work: str) -> None:
    import torch

    from moe.model.config import MoEConfig

    before = rss_mb()
    anon_before = anon_mb()
    sampler = AnonPeak()
    t0 = time.perf_counter()
    if kind == "import":
        from moe.hf.importer import import_model

        import_model(Path(src), Path(work) / "model", MoEConfig(), seq_len=256)
    elif kind == "finetune":
        from moe.hf.model_dir import load_model_dir

        model = load_model_dir(Path(work) / "model", dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        idx = torch.randint(
            0, model.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)
        )
        steps = []
        for _ in range(3):
            s0 = time.perf_counter()
            _, loss, aux = model(idx, idx)
            (loss + aux.balance_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(time.perf_counter() - s0)
        from moe.hf.model_dir import save_model_dir

        save_model_dir(model.to(torch.bfloat16), Path(work) / "tuned")
    else:
        from moe.hf.exporter import export_hf
        from moe.hf.model_dir import load_model_dir

        model = load_model_dir(Path(work) / "tuned")
        export_hf(model, Path(work) / "export", Path(src), {"eos": 1, "pad": 1}, "card")
    out = {
        "seconds": round(time.perf_counter() - t0, 2),
        "rss_before_mb": round(before, 1),
        "peak_mb": round(peak_mb(), 1),
        "anon_before_mb": round(anon_before, 1),
        "anon_peak_mb": round(sampler.stop(), 1),
    }
    if kind == "finetune":
        out["step_s"] = [round(s, 2) for s in steps]
    print(json.dumps(out))


def run_child(kind: str, src: Path, work: Path) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(src), str(work)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--child", nargs=3, default=None)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    from moe.hf.importer import load_hf_model
    from moe.model.config import MoEConfig

    tmp = Path(tempfile.mkdtemp(prefix="hf_bench_"))
    src = tmp / "qwen3_moe"
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32_000,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(src, max_shard_size="200MB")
    vocab = {f"t{i}": i for i in range(32_000)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(src / "tokenizer.json"))
    weights = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    params = sum(p.numel() for p in hf.parameters())
    del hf
    figures: dict = {
        "params_M": round(params / 1e6, 1),
        "weights_MB": round(weights / 1e6, 1),
        "shards": len(list(src.glob("*.safetensors"))),
    }
    for kind in ("import", "finetune", "export"):
        got = run_child(kind, src, tmp)
        got["over_weights"] = round((got["peak_mb"] - got["rss_before_mb"]) * 2**20 / weights, 2)
        got["anon_over_weights"] = round(
            (got["anon_peak_mb"] - got["anon_before_mb"]) * 2**20 / weights, 2
        )
        figures[kind] = got
        print(kind, got, flush=True)
    # Logit differences on the same weights (first two layers' worth of a batch).
    idx = torch.randint(0, 32_000, (2, 64), generator=torch.Generator().manual_seed(1))
    diffs = {}
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref(idx).logits
        ours32, _ = load_hf_model(src, MoEConfig(), 256, torch.float32)
        diffs["fp32_ours_vs_transformers"] = float((ours32.eval()(idx)[0] - ref_logits).abs().max())
        del ours32
        hf16 = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
        theirs16 = hf16(idx).logits.float()
        del hf16
        ours16, _ = load_hf_model(src, MoEConfig(), 256, torch.bfloat16)
        mine16 = ours16.eval()(idx)[0].float()
        diffs["bf16_transformers_vs_fp32"] = float((theirs16 - ref_logits).abs().max())
        diffs["bf16_ours_vs_fp32"] = float((mine16 - ref_logits).abs().max())
        diffs["bf16_ours_vs_transformers"] = float((mine16 - theirs16).abs().max())
        diffs["logit_scale"] = float(ref_logits.abs().max())
    figures["logit_max_abs_diff"] = {k: float(f"{v:.3g}") for k, v in diffs.items()}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

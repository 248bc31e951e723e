"""Our three training methods against transformers + PEFT LoRA on the same weights, on the GPU
our users rent (issue 52), or on the CPU at a tiny shape (a smoke run: the code path, not a
figure).

The model: transformers' own Qwen3-MoE with random weights (`from_config`, saved, then
imported with `model import`'s code). The H200 shape (`--shape gpu`): hidden 1024, 8 layers,
16 heads / 4 KV heads of 64, 64 experts of width 512, top-8, vocab 32,000 (0.89B
parameters), a batch of 8 x 1,024 tokens. Adapters: rank 8 (alpha 16) on q/k/v/o and on the
routed experts, routers frozen.

- Ours: `full`, `lora` and `qlora` through the stages' own training code (`apply_method`,
  `Trainer.fit` with its metrics rows: tokens/s is the row over the timed steps, read where
  the trainer reads the device).
- The peer: transformers + PEFT (`target_modules` q/k/v/o, `target_parameters` on the
  experts' gate_up_proj / down_proj), the model loaded in bf16 (PEFT keeps the adapters in
  fp32), the experts through transformers' grouped_mm, AdamW on the adapters (fused on CUDA),
  the loss over the same targets.

Interleaved A B C D A B C D ... after a warm-up round, medians. Each method's peak is
`torch.cuda.max_memory_allocated` over its rounds less what the other methods hold meanwhile
(constant during a round), beside the memory plan's figure (moe/train/memory.py, as the
stage plans it: width 2 bytes under bf16). MFU counts the active parameters
(`flops_per_token`: 6 N + attention; 4 N for adapters, no weight gradients of the base)
against the GPU's dense bf16 peak (`--peak-tflops`, 989 for an H100/H200 SXM). The host syncs
of a steady step are counted once per method (moe/train/syncs.py), outside the timed rounds.

Run: `python bench/gpu_peer.py --shape gpu` (CUDA) or `--shape tiny` (CPU smoke, seconds).
JSON last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moe.adapters.config import LoraConfig
from moe.adapters.method import apply_method
from moe.checkpoint.store import CheckpointStore
from moe.hf.importer import import_model
from moe.hf.model_dir import load_model_dir, model_dir_skeleton
from moe.model.config import MoEConfig
from moe.train.config import FinetuneConfig
from moe.train.memory import (
    activation_bytes,
    held_tensors,
    peak_bytes,
    state_bytes,
    storage_bytes,
)
from moe.train.syncs import HostSyncs
from moe.train.trainer import Trainer

SHAPES = {
    # hidden, layers, heads, kv heads, head dim, experts, expert width, top-k, vocab, rows, seq
    "gpu": dict(D=1024, L=8, H=16, KV=4, Dh=64, E=64, F=512, K=8, V=32000, B=8, S=1024),
    "tiny": dict(D=64, L=2, H=4, KV=2, Dh=16, E=8, F=32, K=2, V=512, B=2, S=64),
}
OURS = ("full", "lora", "qlora")
RANK, ALPHA = 8, 16.0


def make_hf(folder: Path, s: dict[str, int]) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=s["V"],
        hidden_size=s["D"],
        intermediate_size=4 * s["D"],
        moe_intermediate_size=s["F"],
        num_hidden_layers=s["L"],
        num_attention_heads=s["H"],
        num_key_value_heads=s["KV"],
        head_dim=s["Dh"],
        num_experts=s["E"],
        num_experts_per_tok=s["K"],
        norm_topk_prob=True,
        max_position_embeddings=s["S"],
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


class Batches:
    def __init__(self, s: dict[str, int]) -> None:
        self.s = s

    def batch_at(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, None]:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, self.s["V"], (self.s["B"], self.s["S"] + 1), generator=g)
        return x[:, :-1], x[:, 1:], None


def finetune_cfg(method: str, device: str, compiled: bool = False) -> FinetuneConfig:
    return FinetuneConfig(
        compile=compiled,
        max_steps=1 << 30,
        batch_size=1,  # the batch source decides the rows
        lr=1e-4,
        warmup_steps=0,
        device=device,
        method=method,  # type: ignore[arg-type]
        lora=LoraConfig(rank=RANK, alpha=ALPHA),
        router="frozen",
        checkpoint_every=1 << 30,
        log_every=1 << 30,
    )


class Ours:
    """One method through the stage's code: apply_method, then Trainer.fit in rounds of
    `steps` (stop_after), each round one metrics row."""

    def __init__(
        self, imported: Path, method: str, device: str, s: dict, ckpt: Path, compiled: bool
    ) -> None:
        self.cfg = finetune_cfg(method, device, compiled)
        model = load_model_dir(imported, dtype=torch.float32)
        self.flops = model.flops_per_token() * (1.0 if method == "full" else 4 / 6)
        apply_method(model, self.cfg, method)
        self.rows: list[dict[str, Any]] = []
        self.trainer = Trainer(
            model,
            self.cfg,
            Batches(s),
            CheckpointStore(ckpt, hot_codec="raw", background=False),
            fingerprint=method,
            schedule="linear",
            expert_warmup=False,
            base_sha256=None if method == "full" else "bench",
            log_fn=self.rows.append,
        )

    def held(self) -> int:
        return held_bytes(self.trainer.model, self.trainer.optimizer)

    def run(self, steps: int) -> float:
        """Tokens/s of `steps` steps: the trainer's own row over them (the row reads the
        device, so the time includes the GPU's work)."""
        t = self.trainer
        t.cfg.log_every = t.step + steps  # one row, at the end of the round
        t.stop_after = steps
        t.fit()
        return float(self.rows[-1]["tokens_per_s"])

    def syncs(self) -> int:
        """Host syncs in one steady step between rows (the optimizer's host counters aside)."""
        t = self.trainer
        t.cfg.log_every, t.stop_after = t.step + 10, 2
        first = t.step

        def host_counter(args: tuple) -> bool:
            return any(args[0] is st.get("step") for st in t.optimizer.state.values())

        with HostSyncs(lambda: t.step, host_counter) as h:
            t.fit()
        return sum(h.at(first + 1).values())


class Peer:
    """transformers + PEFT LoRA: bf16 model, fp32 adapters, AdamW on the adapters."""

    def __init__(self, hf: Path, device: torch.device, s: dict) -> None:
        import peft
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
        model.config._experts_implementation = "grouped_mm"
        cfg = peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
        self.model = peft.get_peft_model(model, cfg).to(device)
        for p in self.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # PEFT's autocast_adapter_dtype: adapters in fp32
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        self.device, self.batches, self.s = device, Batches(s), s
        self.step_no = 0

    def held(self) -> int:
        return held_bytes(self.model, self.opt)

    def run(self, steps: int) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y, _ = self.batches.batch_at(self.step_no)
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step_no += 1
        float(loss)
        sync()
        return steps * x.numel() / (time.perf_counter() - t0)


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of what an arm holds between its rounds (its weights, buffers, optimizer state)."""
    return sum(n for t in held_tensors(model, optimizer) for _, n in storage_bytes(t))


def plan_peak(imported: Path, method: str, s: dict, width: int) -> float:
    """The memory plan's peak for this method and batch, as a stage on this device plans it
    (width 2: bf16 autocast on a GPU)."""
    m, amp = model_dir_skeleton(imported), width == 2
    lcfg = LoraConfig(rank=RANK, alpha=ALPHA)
    state = state_bytes(m.cfg, m.mcfg, m.vocab_size, method, lcfg, amp=amp)
    acts = activation_bytes(m.cfg, m.mcfg, m.vocab_size, s["B"], s["S"], 1.0, width, amp=amp)
    return peak_bytes(state, acts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="auto", help="auto: cuda when there is one")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds after warm-up")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak")
    ap.add_argument("--methods", nargs="+", default=[*OURS, "peft"])
    ap.add_argument(
        "--compile", action="store_true", help="also each of ours with compile: true (+c)"
    )
    args = ap.parse_args()
    s = SHAPES[args.shape]
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"shape": s, "device": str(device), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        make_hf(tmp_p / "hf", s)
        import_model(tmp_p / "hf", tmp_p / "imported", MoEConfig(), seq_len=s["S"])
        arms: dict[str, Any] = {}
        for m in args.methods:
            if m == "peft":
                arms[m] = Peer(tmp_p / "hf", device, s)
                continue
            arms[m] = Ours(tmp_p / "imported", m, device.type, s, tmp_p / f"ck-{m}", False)
            if args.compile:
                arms[f"{m}+c"] = Ours(tmp_p / "imported", m, device.type, s, tmp_p / f"c-{m}", True)
        speeds: dict[str, list[float]] = {m: [] for m in arms}
        peaks: dict[str, int] = dict.fromkeys(arms, 0)
        for r in range(1 + args.rounds):  # round 0: warm-up (kernels, allocator, state)
            for m, arm in arms.items():
                if cuda:
                    torch.cuda.synchronize()
                    others = torch.cuda.memory_allocated() - arm.held()
                    torch.cuda.reset_peak_memory_stats()
                tps = arm.run(args.steps)
                if cuda:
                    peaks[m] = max(peaks[m], torch.cuda.max_memory_allocated() - others)
                if r:
                    speeds[m].append(tps)
                print(f"round {r} {m:6s} {tps:12,.0f} tokens/s", flush=True)
        width = 2 if cuda else 4
        flops = {m: a.flops for m, a in arms.items() if isinstance(a, Ours)}
        if "peft" in arms and "lora" in flops:
            flops["peft"] = flops["lora"]
        for m, arm in arms.items():
            tps = statistics.median(speeds[m])
            row: dict[str, Any] = {"tokens_per_s": round(tps)}
            if m in flops and cuda:
                row["mfu"] = round(tps * flops[m] / (args.peak_tflops * 1e12), 4)
            if cuda:
                row["peak_gb"] = round(peaks[m] / 1e9, 3)
            if isinstance(arm, Ours):
                plan = plan_peak(tmp_p / "imported", arm.cfg.method, s, width)
                row["plan_gb"] = round(plan / 1e9, 3)
                if cuda and peaks[m]:
                    row["plan_over_peak"] = round(plan / peaks[m], 3)
                row["host_syncs_per_step"] = arm.syncs()
            out[m] = row
        if "peft" in out:
            ref = out["peft"]
            for m in arms:
                if m != "peft":
                    out[m]["speed_vs_peft"] = round(out[m]["tokens_per_s"] / ref["tokens_per_s"], 3)
                    if cuda:
                        out[m]["peak_vs_peft"] = round(out[m]["peak_gb"] / ref["peak_gb"], 3)
        if "lora" in out and "qlora" in out:
            out["qlora"]["speed_vs_lora"] = round(
                out["qlora"]["tokens_per_s"] / out["lora"]["tokens_per_s"], 3
            )
            if cuda:
                out["qlora"]["peak_vs_lora"] = round(
                    out["qlora"]["peak_gb"] / out["lora"]["peak_gb"], 3
                )
    for m in arms:
        print(f"{m:6s} {out[m]}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

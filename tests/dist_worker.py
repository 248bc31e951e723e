"""Worker for tests/test_distributed.py: the real Trainer on the sharded engine, launched by
torchrun (gloo, CPU), or called in the test's process at world size 1.

`python -m torch.distributed.run --standalone --nproc_per_node N tests/dist_worker.py MODE OUT [ARGS]`

MODE train STORE STEPS STOP EP [DEVICE [FLAGS]]: train to STEPS (returning after STOP steps
           of this call when STOP > 0: a kill), checkpoints every 2 steps under OUT/STORE;
           rank 0 writes the final weights (gathered) to OUT/STORE.safetensors and the
           result (with every step's gradient norm) to OUT/STORE.json. Every rank writes
           OUT/STORE.rank<R>.json: the elements of model and optimizer state it holds.
           FLAGS, comma-separated: ac (activation checkpointing), bf16, lora; aux (the
           aux-loss balancing, coefficient 0.1, instead of aux-free), clip (grad_clip
           0.05: binds), cold (the store's cold threshold at the mean load, cold codec
           lzma: every layer has cold experts); rng (afterwards, the jitter resume check
           `rng_resume` at the same world and expert degree); deepseek (DeepSeek-V3's
           shape: latent attention, sigmoid group-limited routing, a shared expert); gptoss
           (gpt-oss's: sinks, windows, biases everywhere, the clamped SwiGLU, YaRN).
MODE die:  rank 1 exits hard in the middle of the first step; rank 0 must fail, not hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from moe.adapters.config import LoraConfig
from moe.adapters.method import apply_method
from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import model_tensors
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer
from moe.train import distributed as D
from moe.train.config import PretrainConfig
from moe.train.trainer import Trainer, TrainResult

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 64
CLIP = 0.05  # flag clip: under every step's gradient norm (the test checks that it binds)


# flag deepseek: DeepSeek-V3's shape (latent attention, sigmoid routing in 2 groups of 2 of
# which a token may use 1, a routed scale, a shared expert), both blocks MoE
DEEPSEEK_MODEL = dict(
    attention="mla", head_dim=16, mla_q_rank=16, mla_kv_rank=16, mla_rope_dim=8, mla_v_dim=12
)
DEEPSEEK_MOE = dict(
    score_func="sigmoid", n_group=2, topk_group=1, routed_scale=2.5, shared_expert=True
)

# flag gptoss: gpt-oss's shape (sinks, a window on every other block, q/k/v/o biases, expert
# biases and the clamped SwiGLU, a router bias, YaRN)
GPT_OSS_MODEL = dict(
    attn_bias=True,
    attn_out_bias=True,
    attn_sinks=True,
    sliding_window=4,
    sliding_layers=[0],
    rope_type="yarn",
    rope_scaling=dict(factor=4.0, original_max_position_embeddings=8.0),
)
GPT_OSS_MOE = dict(activation="clamped_swiglu", expert_proj_bias=True, router_logit_bias=True)


def build(
    meta: bool = False,
    aux: bool = False,
    jitter: float = 0.0,
    deepseek: bool = False,
    gptoss: bool = False,
) -> MoETransformer:
    """The model, seeded; on the meta device (shapes only) for the sharded engine to fill.
    aux: the Switch aux loss balances (weighty enough to move the routers), not aux-free;
    jitter: the routers' input noise (drawn from each rank's torch RNG)."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return MoETransformer(
            ModelConfig(
                n_layer=2,
                n_head=2,
                d_model=32,
                seq_len=SEQ,
                dense_hidden=64,
                **(DEEPSEEK_MODEL if deepseek else {}),
                **(GPT_OSS_MODEL if gptoss else {}),
            ),
            MoEConfig(
                num_experts=4,
                top_k=2,
                expert_hidden=32,
                balancing=["aux_loss", "z_loss"] if aux else ["aux_free", "z_loss", "rebalance"],
                aux_loss_coef=0.1,
                jitter=jitter,
                **(DEEPSEEK_MOE if deepseek else {}),
                **(GPT_OSS_MOE if gptoss else {}),
            ),
            VOCAB,
        )


class Batches:
    """A fixed global batch per step: the same rows at any world size."""

    def batch_at(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, None]:
        g = torch.Generator().manual_seed(1000 * step + micro)
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        return x[:, :-1], x[:, 1:], None


def optim_cfg(
    steps: int,
    ep: int,
    device: str = "cpu",
    ac: bool = False,
    bf16: bool = False,
    lora: bool = False,
    clip: bool = False,
) -> PretrainConfig:
    return PretrainConfig(
        method="lora" if lora else "full",
        lora=LoraConfig(rank=4, alpha=8.0),
        router="bias-only" if lora else "auto",
        max_steps=steps,
        batch_size=GLOBAL_BATCH,
        lr=1e-2,
        warmup_steps=1,
        checkpoint_every=2,
        log_every=1,
        device=device,
        expert_parallel=ep,
        activation_checkpoint=ac,
        dtype="bfloat16" if bf16 else "auto",
        grad_clip=CLIP if clip else 1.0,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held(trainer: Trainer) -> dict[str, int | str]:
    """Elements this rank holds: parameters and optimizer moments; and the digest of its
    experts' values (the data-parallel copies of an expert agree)."""

    def n(t: torch.Tensor) -> int:
        return _local(t).numel()

    params = list(trainer.model.parameters())
    moments = sum(
        n(v) for st in trainer.optimizer.state.values() for k, v in st.items() if k != "step"
    )
    experts = hashlib.sha256()
    for name, p in trainer.model.named_parameters():
        if ".experts." in name:
            experts.update(_local(p).detach().cpu().numpy().tobytes())
    return {
        "params": sum(n(p) for p in params),
        "moments": moments,
        "experts_sha": experts.hexdigest(),
    }


def train(
    out: Path,
    store_name: str,
    steps: int,
    stop: int,
    ep: int,
    device: str = "cpu",
    flags: tuple[str, ...] = (),
) -> None:
    cfg = optim_cfg(
        steps, ep, device, "ac" in flags, "bf16" in flags, "lora" in flags, "clip" in flags
    )
    cold = {"cold_threshold": 1.0, "cold_codec": "bg-lzma"} if "cold" in flags else {}
    store = CheckpointStore(out / store_name, max_retain=3, background=True, **cold)
    model = build(
        meta=torch.distributed.is_initialized(),
        aux="aux" in flags,
        deepseek="deepseek" in flags,
        gptoss="gptoss" in flags,
    )
    rows: list[dict] = []
    if "lora" in flags:  # adapters on every target over a frozen base, before sharding
        apply_method(model, cfg, "worker")
    trainer = Trainer(
        model,
        cfg,
        Batches(),
        store,
        fingerprint="dist-worker",
        schedule="cosine",
        router_lr_mult=3.0,
        stop_after=stop or None,
        base_sha256="random-base" if "lora" in flags else None,
        log_fn=rows.append,  # rank 0's metrics rows
    )
    result = trainer.fit()
    store.close()
    rank = trainer.ranks.rank
    full = (
        D.full_tensors(D.unique_state(trainer.model), keep=rank == 0)
        if trainer.ranks.world > 1
        else model_tensors(trainer.model)
    )
    (out / f"{store_name}.rank{rank}.json").write_text(json.dumps(held(trainer)))
    if rank == 0:
        save_file(full, str(out / f"{store_name}.safetensors"))
        (out / f"{store_name}.json").write_text(
            json.dumps(
                {
                    "steps": result.steps,
                    "resumed_from": result.resumed_from,
                    "loss": result.train_loss,
                    "backend": result.backend,
                    "world": result.world,
                    "sharded": trainer.ranks.meshes is not None,
                    "expert_share": result.expert_share,
                    "grad_norms": [r["grad_norm"] for r in rows if "grad_norm" in r],
                }
            )
        )
    if "rng" in flags:
        rng_resume(out, steps, ep)


def _jitter_run(
    out: Path, store_name: str, steps: int, stop: int, ep: int, seed: int
) -> tuple[Trainer, TrainResult]:
    """A jitter-routed run (aux-free balancing), its torch RNG seeded `seed` once the model
    is built: every rank draws its own router noise."""
    store = CheckpointStore(out / store_name, max_retain=3, background=True)
    trainer = Trainer(
        build(meta=torch.distributed.is_initialized(), jitter=0.2),
        optim_cfg(steps, ep),
        Batches(),
        store,
        fingerprint="dist-worker-jitter",
        schedule="cosine",
        stop_after=stop or None,
    )
    torch.manual_seed(seed)
    result = trainer.fit()
    store.close()
    return trainer, result


def rng_resume(out: Path, steps: int, ep: int) -> None:
    """Every rank's RNG carries across a resume: a jitter-routed run killed after step 3
    (its last checkpoint: step 2) and resumed (its RNG seeded otherwise before the resume
    restores it) ends bit-identical to the uninterrupted run, on every rank. Each rank
    writes OUT/rng.rank<R>.json: the local tensors that differ, whether its final RNG state
    equals the uninterrupted run's, that state's digest, and where the resume began."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    whole, _ = _jitter_run(out, "jit", steps, 0, ep, seed=100 + rank)
    rng = torch.get_rng_state()
    _jitter_run(out, "jit_r", steps, 3, ep, seed=100 + rank)  # killed: resumes from step 2
    again, result = _jitter_run(out, "jit_r", steps, 0, ep, seed=7)
    want, got = D.unique_state(whole.model), D.unique_state(again.model)
    local = [(n, _local(want[n]), _local(got[n])) for n in want]
    (out / f"rng.rank{rank}.json").write_text(
        json.dumps(
            {
                "differ": [n for n, w, g in local if not torch.equal(w, g)],
                "rng_equal": torch.equal(torch.get_rng_state(), rng),
                "rng_sha": hashlib.sha256(rng.numpy().tobytes()).hexdigest(),
                "resumed_from": result.resumed_from,
                "steps": result.steps,
            }
        )
    )


def notice(out: Path) -> None:
    """Rank 1 alone is asked to stop from step 2 on; metrics rows every 4 steps, no save
    planned before step 100. Each rank writes OUT/notice.rank<R>.json: where it stopped,
    why, its training time, and how often it met the other ranks to agree (`agree_max`)."""
    cfg = optim_cfg(8, 0)
    cfg.log_every, cfg.checkpoint_every = 4, 100
    holder: list[Trainer] = []

    def interrupted() -> bool:
        return holder[0].ranks.rank == 1 and holder[0].step >= 2

    trainer = Trainer(build(meta=True), cfg, Batches(), CheckpointStore(out / "notice"),
                      fingerprint="notice", schedule="cosine", interrupted=interrupted)  # fmt: skip
    holder.append(trainer)
    calls: list[int] = []
    agree = trainer.ranks.agree_max
    trainer.ranks.agree_max = lambda v: calls.append(trainer.step) or agree(v)  # type: ignore[method-assign]
    result = trainer.fit()
    (out / f"notice.rank{trainer.ranks.rank}.json").write_text(
        json.dumps(
            {
                "steps": result.steps,
                "stop": result.stop_reason,
                "elapsed_s": trainer.state.progress.elapsed_s,
                "agreed_at": calls,
            }
        )
    )


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    device = sys.argv[7] if len(sys.argv) > 7 else "cpu"
    if "WORLD_SIZE" in os.environ:
        D.init(timeout_s=20, device=device)  # gloo on CPU tensors, GPU or not
    if mode == "train":
        store, steps, stop, ep = sys.argv[3], *map(int, sys.argv[4:7])
        flags = tuple(sys.argv[8].split(",")) if len(sys.argv) > 8 else ()
        train(out, store, steps, stop, ep, device, flags)
    elif mode == "notice":
        notice(out)
    elif mode == "die":
        trainer = Trainer(
            build(),
            optim_cfg(4, 0),
            Batches(),
            CheckpointStore(out / "die"),
            fingerprint="die",
            schedule="cosine",
        )
        if trainer.ranks.rank == 1:
            os._exit(3)  # a machine that disappears: no exception, no goodbye
        trainer.fit()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

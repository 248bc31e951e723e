"""What a training stage holds in memory, by method, from the model's shapes alone (a model
on the meta device: nothing is allocated or drawn), and the measured peak it is held to.

- weights: fp32 (the trainer keeps fp32 weights and computes under bf16 autocast on CUDA),
  QLoRA's adapted projections in NF4 (4 bits, an int8 scale per block, an fp32 scale per
  256 blocks);
- trainable state: each trained parameter's gradient and AdamW's two moments (fp32).

- activations: what the backward keeps of one micro-batch, counted from the tensors each
  op of a block saves (`activation_bytes`), in fp32 on the CPU; under bf16 autocast (`amp`)
  at 2 bytes, except what stays fp32 there: the router's logits and probabilities, the
  experts' outputs copied to fp32 for the weighted sum, and the loss (fp32 log-probabilities,
  and in the first step of the backward their gradient and the logits' gradient beside them);
- one process under bf16 autocast (`amp`) also holds what autocast adds to the weights: a
  bf16 copy of every fp32 weight a product reads, kept for the backward (the trained
  weights' copies are cached for the whole forward, the frozen ones' are saved by their
  product), the largest weight's bf16 gradient before it joins the fp32 one (full), and
  QLoRA's largest weight while torchao dequantises it for its product; LoRA
  holds its adapted frozen weights in bf16 there (moe/adapters/method.py frozen_dtype). Under
  FSDP2 the gathered weights are bf16 already and nothing is copied.

Sharded over the stage's processes (FSDP2 for dense weights, expert parallelism for the
experts), each GPU holds its share of the weights and state, and the activations of its own
rows. `HEADROOM` of a GPU is what they may use (the rest: the allocator, communication
buffers). `peak_bytes` is held to `measure_peak` (a real step, every storage tracked) on
models of several sizes (tests/test_lora.py): in fp32 within 15% either way (5% for full
finetuning of DeepSeek-V3's shape); under bf16 autocast never below the peak, and at most 10%
above it for full finetuning, 40% for LoRA and QLoRA (their frozen products keep less for the
backward than is counted).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe.adapters.config import LoraConfig
from moe.adapters.lora import adapter_counts
from moe.model.config import ModelConfig, MoEConfig
from moe.model.experts import EXPERT_BIASES
from moe.model.transformer import MoETransformer

HEADROOM = 0.9  # of a GPU's memory for weights, trainable state and activations
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # per weight: codes, block scales, their scales
# Bytes a weight while torchao dequantises an NF4 weight for its product (its temporaries,
# the fp32 result, the bf16 cast): measured 21.06 on the CPU (bench/RESULTS.md).
NF4_DEQUANT_PEAK = 21.0


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one whole copy of a stage's weights and trainable state."""

    params: int  # the model's parameters
    trainable: int  # parameters that train (adapters, or all of them)
    weights: float
    trainable_state: float  # gradients + AdamW moments of the trainable parameters
    single_process: bool = False  # QLoRA: its NF4 base is not sharded
    # A micro-batch's activations on each of n GPUs (its rows split over them); None = 0.
    activations: Callable[[int], float] | None = None
    # What one process under bf16 autocast adds (autocast's weight copies, QLoRA's dequantised
    # weight) less what it saves (LoRA's bf16 frozen base); 0 elsewhere.
    one_process: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.trainable_state

    def per_gpu(self, n: int) -> float:
        """Bytes on each of n GPUs: a share of the weights and state, its rows' activations
        (and, on one GPU, what autocast adds there)."""
        acts = self.activations(n) if self.activations else 0.0
        return self.total / n + acts + (self.one_process if n == 1 else 0.0)

    def gpus_needed(self, gpu_memory_gib: float, most: int = 1 << 16) -> int:
        """The fewest GPUs of this memory that hold it (HEADROOM of each used); `most` + 1
        when no count does (one row's activations alone do not fit)."""
        cap = gpu_memory_gib * 2**30 * HEADROOM
        if self.per_gpu(most) > cap:
            return most + 1
        lo, hi = 1, most  # per_gpu falls as n grows: the first n that fits
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.per_gpu(mid) <= cap else (mid + 1, hi)
        return lo


def _product_weights(model: MoETransformer) -> int:
    """Weights that a product under autocast reads (and copies to bf16): every matrix but
    the embedding table (a lookup), the routers (scored in fp32) and the experts' biases
    (added, 2-D only for their expert axis); a tied head is one."""
    skip = {id(layer.router.gate.weight) for layer in model.moe_layers}
    skip |= {id(p) for layer in model.moe_layers for p in _expert_biases(layer.experts)}
    if not model.cfg.tie_embeddings:
        skip.add(id(model.embed.weight))
    return sum(p.numel() for p in model.parameters() if p.ndim >= 2 and id(p) not in skip)


def largest_adapted(model: MoETransformer, lora: LoraConfig) -> int:
    """The largest dense projection `lora` adapts (the attention's, when its experts are not
    adapted): the largest weight QLoRA stores in NF4 there."""
    sizes = [
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and lora.targets.attention and ".attn." in f".{name}."
    ]
    return max(sizes, default=0)


def _expert_biases(experts: torch.nn.Module) -> list[torch.Tensor]:
    return [b for b in (getattr(experts, n, None) for n in EXPERT_BIASES) if b is not None]


def state_bytes(
    model_cfg: ModelConfig,
    moe_cfg: MoEConfig,
    vocab: int,
    method: str,
    lora: LoraConfig,
    amp: bool = False,
) -> StateBytes:
    """What `method` ("full", "lora", "qlora") holds for this architecture; `amp`: computed
    under bf16 autocast (a GPU), which changes what one process holds (`one_process`)."""
    with torch.device("meta"):
        model = MoETransformer(model_cfg, moe_cfg, vocab)
    params = model.num_params()
    products = _product_weights(model)
    largest = max((p.numel() for p in model.parameters()), default=0)
    if method == "full":
        # the bf16 copies, and the largest weight's bf16 gradient before it joins its fp32 one
        one = 2.0 * (products + largest) if amp else 0.0
        return StateBytes(params, params, 4.0 * params, 12.0 * params, one_process=one)
    adapters, adapted = adapter_counts(model, lora)
    trainable = adapters
    if lora.train_embeddings:
        trainable += model.embed.weight.numel()
    if lora.train_head and not model_cfg.tie_embeddings:
        trainable += model.lm_head.weight.numel()
    base = 4.0 * (params - adapted) + (NF4_BYTES if method == "qlora" else 4.0) * adapted
    one = 0.0
    if amp:
        # the adapters' bf16 copies; the frozen fp32 products outside the adapted ones (the
        # head, untargeted projections); LoRA's adapted base in bf16 (2 bytes less each);
        # QLoRA's largest NF4 weight dequantised to fp32 and cast to bf16 for its product
        # (a trained head is among the products once; a trained embedding is a lookup)
        one = 2.0 * (adapters + products - adapted)
        if method == "lora":
            one -= 2.0 * adapted
        else:  # the largest NF4 weight: an expert layer's gate/up, or a targeted projection
            nf4 = [layer.experts.w13_EDG.numel() for layer in model.moe_layers]
            nf4 = nf4 if lora.targets.experts else [largest_adapted(model, lora)]
            one += NF4_DEQUANT_PEAK * max(nf4, default=0)
    return StateBytes(
        params + adapters,
        trainable,
        base + 4.0 * adapters,
        12.0 * trainable,
        single_process=method == "qlora",
        one_process=one,
    )


def activation_bytes(
    model_cfg: ModelConfig,
    moe_cfg: MoEConfig,
    vocab: int,
    rows: int,
    seq: int,
    loss_fraction: float = 1.0,
    bytes_per: int = 4,
    amp: bool = False,
) -> float:
    """What the backward keeps of a micro-batch of `rows` x `seq` tokens (`loss_fraction` of
    the positions carrying a loss: the head runs there only), from what each op saves:
    - attention: the block input, RMSNorm's normalised input and output (3 T D), the fused
      q/k/v output, the rotated q and k, the attention output and its log-sum-exp, the
      output projection's input;
    - MoE: the second norm (3 T D), router logits and probabilities, and per assignment
      (A = T K) the gathered input, the gate/up product, SiLU and SwiGLU outputs, the expert
      output and its fp32 copy for the weighted sum; a dense block: norm and four T F;
      a shared expert: four T F;
    - the final norm, and the logits and log-probabilities of the positions with a loss.
    `amp` (bf16 autocast, bytes_per 2): the norms' input and normalised product, the
    router's three, the experts' fp32 copies and the loss in fp32: the log-probabilities,
    their gradient and the logits' (12 bytes a logit at the backward's first step)."""
    c, m = model_cfg, moe_cfg
    T = rows * seq
    D, Q, KV = c.d_model, c.n_head * c.head_width, c.kv_heads * c.head_width
    attn = T * (3 * D + (Q + 2 * KV) + Q + KV + 2 * Q + c.n_head)
    if c.attention == "mla":  # latents and their norms, q, kv_b's output, rotated q, k, v, out
        H, qk = c.n_head, c.head_width + c.mla_rope_dim
        latents = 3 * (c.mla_q_rank + c.mla_kv_rank + c.mla_rope_dim)
        kv_b = H * (c.head_width + c.v_width)
        attn = T * (3 * D + latents + 3 * H * qk + kv_b + 2 * H * c.v_width + H)
    total = 0.0
    for i in range(c.n_layer):
        total += attn
        if c.is_moe_block(i):
            A, F_ = T * m.top_k, m.expert_hidden
            total += 3 * T * D + 3 * T * m.num_experts + A * (3 * D + 4 * F_)
            if m.shared_expert:
                total += 4 * T * (m.shared_expert_hidden or F_)
        else:
            total += 3 * T * D + 4 * T * c.dense_hidden
    if not amp:
        total += 3 * T * D + 2 * loss_fraction * T * vocab
        return total * bytes_per
    # each RMSNorm (two a block, one at the end) keeps its input (the fp32 residual stream)
    # and its normalised product in fp32
    fp32 = 12 * loss_fraction * T * vocab + (4 - bytes_per) * 2 * T * D * (2 * c.n_layer + 1)
    for i in range(c.n_layer):
        if c.is_moe_block(i):  # router logits/probabilities, the fp32 copy of each output
            fp32 += (4 - bytes_per) * (3 * T * m.num_experts + T * m.top_k * D)
    return (total + 3 * T * D) * bytes_per + fp32


def peak_bytes(state: StateBytes, activations: float, grad_accum: int = 1) -> float:
    """The peak of a step: the weights, AdamW's moments and one micro-batch's activations
    (gradients too when micro-batches accumulate them), or at the end of the backward the
    weights, moments and all gradients."""
    grads = state.trainable_state / 3
    moments = state.trainable_state - grads
    weights = state.weights + state.one_process
    during = weights + moments + activations + (grads if grad_accum > 1 else 0.0)
    return max(during, weights + moments + grads)


def storage_bytes(t: torch.Tensor) -> list[tuple[int, int]]:
    """(storage id, bytes) of a tensor, or of a tensor subclass's inner tensors (NF4)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in storage_bytes(getattr(t, n))]
    st = t.untyped_storage()
    return [(st.data_ptr(), st.nbytes())]


class _LiveBytes(TorchDispatchMode):
    """Live storage bytes: what exists at the start, plus every storage an op creates
    until it is freed; the peak."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        for t in tensors:
            self.live.update(storage_bytes(t))
        self.peak = sum(self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for key, n in storage_bytes(t):
                    if key not in self.live and n:
                        self.live[key] = n
                        weakref.finalize(t.untyped_storage(), self.live.pop, key, None)
                self.peak = max(self.peak, sum(self.live.values()))
        return out


def held_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a training process holds between steps: the model's parameters and buffers and
    the optimizer's state (what `measure_peak` counts from the start)."""
    held = [*model.parameters(), *model.buffers()]
    return held + [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]


def measure_peak(held: list[torch.Tensor], step: Callable[[], None]) -> int:
    """The peak live tensor bytes while `step` runs on the CPU, counting `held` (the model,
    the optimizer state) from the start. torch's MemTracker refuses frozen parameters."""
    with _LiveBytes(held) as mode:
        step()
    return mode.peak

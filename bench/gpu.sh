#!/usr/bin/env bash
# The GPU checks of issue 27 as one prepared script, for a lent machine (the `device` tool):
#   1. tests/test_cuda.py (bf16 training and resume, CUDA against CPU, FSDP2 on one GPU over
#      NCCL, two-GPU data + expert parallel where there are two GPUs);
#   2. bench/gpu_train.py: a ~100M-active-parameter MoE in bf16 on FSDP2 for 300 steps,
#      tokens/s and model FLOP utilisation;
#   3. bench/moe_layer.py on CUDA (ours against HF Qwen3-MoE's block and the dense limit);
#   4. bench/gpu_peer.py (issue 52): our full / lora / qlora through the stage's training
#      code against transformers + PEFT LoRA on the same 0.89B Qwen3-MoE, interleaved:
#      tokens/s, peak memory beside the plan's figure, MFU, host syncs per step;
#   5. the recipes (`python -m moe.recipes`, issue 54) without Prefect: pretrain, its resume,
#      finetune_sql, on the carried data/prepared;
#   6. bench/packing.py: packed finetuning rows against one example a row (issue 66);
#   7. bench/moe_vs_dense.py at a scale where the literature sees the MoE's gain per token
#      (two seeds, 2000 steps of 64 x 512 tokens: 65M tokens a run), after `prepare`.
# Each step has its own time limit and log under $OUT (the device tool brings $OUT back);
# one failing step does not stop the others. The figures go into bench/RESULTS.md, marked
# with the card that ran them (gpu.txt: an H100 or an H200).
#
# The lent machine's image has PyTorch, safetensors, tokenizers, transformers and PyYAML but
# not zstandard, torchao or Prefect: carry zstandard and torchao as wheels and install them
# into the interpreter itself (`python3 -m pip install --no-index --no-deps WHEELS`: the
# torchrun tests set PYTHONPATH to the project alone, so a --target folder is lost).
# Steps 1-5 need only the `moe` package (and peft for step 4); step 6 needs the pipeline's
# `prepare` stage and is skipped, saying so, where its imports are missing.
#
# The limits add up to more than one device call (600 s at most) and a session's device time
# (15 minutes): run the steps in parts, each call naming its steps in ONLY, e.g.
#   ONLY="cuda_tests flex_tests packing" bash bench/gpu.sh
#   ONLY="gpu_peer moe_layer" bash bench/gpu.sh
#   device: bash bench/gpu.sh        (PY=python3 there; OUT is set by the device tool)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1

step() {  # step NAME SECONDS CMD...: run with a limit, keep the log, say how it ended
  local name=$1 limit=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    echo "=== $name: not in ONLY ($ONLY)"
    return 0
  fi
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

step cuda_tests 240 "$PY" -m pytest -q -p no:randomly tests/test_cuda.py
# packed rows through FlexAttention: loss and gradients of the examples unpacked (issue 66)
step flex_tests 180 "$PY" -m pytest -q -p no:randomly tests/test_packing.py -k flex
step train_fsdp2 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
  bench/gpu_train.py --steps 300
step gpu_peer 480 "$PY" bench/gpu_peer.py --shape gpu --steps 5 --rounds 3 --compile
step moe_layer 180 "$PY" bench/moe_layer.py --device cuda --tokens 32768 --d-model 1024 \
  --hidden 1024 --experts 64 --top-k 4
# Packed finetuning against one example a row (issue 66) on the demo's prepared SQL pairs
# (carried: data/prepared), the demo's model shape at random, bf16 on the GPU: real tokens per
# second of each arm, interleaved; packed rows through FlexAttention and through SDPA's mask.
if [ -f data/prepared/meta.json ]; then
  step packing 240 "$PY" bench/packing.py . --fresh --device cuda --steps 6 --rounds 4
fi
# The stages' own training where Prefect is not installed (issue 54): pretrain then
# finetune_sql through `python -m moe.recipes` on the demo's prepared data (carried:
# data/prepared, 7 MB), on the GPU in bf16; a second pretrain run resumes from its checkpoint.
if [ -f data/prepared/meta.json ]; then
  R=(--set pretrain.device=cuda --set finetune_sql.device=cuda --set pretrain.max_steps=200)
  step recipes_pretrain 180 "$PY" -m moe.recipes pretrain "${R[@]}" --out "$OUT/recipes/pretrain"
  step recipes_resume 60 "$PY" -m moe.recipes pretrain "${R[@]}" --out "$OUT/recipes/pretrain"
  step recipes_finetune 180 "$PY" -m moe.recipes finetune --stage finetune_sql "${R[@]}" \
    --init "$OUT/recipes/pretrain" --out "$OUT/recipes/finetune_sql"
  rm -rf "$OUT/recipes"  # the logs are what comes back
else
  echo "=== recipes: skipped (no data/prepared: carry it, after make demo)"
fi

if "$PY" -c "import prefect, zstandard" 2>/dev/null; then
  "$PY" - <<'EOF' >"$OUT/params-gpu.yaml"
import yaml
p = yaml.safe_load(open("params.yaml"))
p["model"].update(d_model=512, n_layer=8, n_head=8, seq_len=512, dense_hidden=2048)
p["moe"].update(num_experts=16, top_k=2, expert_hidden=1024)
p["pretrain"].update(batch_size=64, device="cuda", eval_every=500, log_every=50)
print(yaml.safe_dump(p, sort_keys=False))
EOF
  step prepare 300 "$PY" -m flows.cli stage prepare --params "$OUT/params-gpu.yaml"
  step moe_vs_dense 1200 "$PY" bench/moe_vs_dense.py --params "$OUT/params-gpu.yaml" \
    --steps 2000 --budget-s 120 --seeds 1337 1338
else
  echo "=== moe_vs_dense: skipped (prefect or zstandard is not importable on this machine)"
fi

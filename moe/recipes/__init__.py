"""What a stage trains and measures, as plain functions that run wherever torch does: a
rented GPU with torch and transformers alone (no Prefect, DVC or W&B), a torchrun rank, a
Kubernetes pod, a notebook, or a Prefect task (tasks/pretraining.py, tasks/finetuning.py,
tasks/evaluation.py wrap them with retries, launches, storage, lineage and the bill).

- `params.py`: the params tree the recipes read (the library's sections, composed) and its
  strict reading from a params file and `--set` overrides;
- `context.py`: what a recipe needs from where it runs (`RunContext`: the checkpoint store,
  the budget, the resilience settings, a metrics callback, what a stop notice looks like);
- `fit.py`: the fit-and-save around the trainer and what decides whether a checkpoint is
  resumed (the fingerprint);
- `pretrain.py`, `finetune.py`: the stages' training; `evaluate.py`: the model-level part of
  evaluation (held-out perplexity);
- `load.py`: the params as a run outside the pipeline reads them (model.init resolved, the
  torchrun process count checked);
- `__main__.py`: `python -m moe.recipes pretrain|finetune|perplexity --params FILE`.

The model folder a recipe reads and writes is moe/hf/model_dir.py's, the same for every stage,
`model import` and `model export`.
"""

"""Training: the trainer and its named parts. Imports the model and the checkpoint store,
nothing of SQL, Hugging Face or evaluation.

- trainer.py: `Trainer.fit()`, a short list of calls to the parts below;
- ranks.py: device, autocast, ranks and the sharded engine's meshes (distributed.py:
  FSDP2 + expert parallelism);
- optim.py: AdamW's groups, the lr schedule, the optimizer state as checkpoints hold it;
- validation.py: the held-out loss and perplexity; stop.py: the stop policy and budget;
  early_stop.py: the early stopper;
- cadence.py: when to save; checkpointer.py: the training state collected from its parts,
  saved and restored; rng.py: the random generators' state;
- metrics.py: metrics rows and the logging window; resilience.py: the attempt journal and
  the Young/Daly interval;
- method.py: what a stage trains (full, lora, qlora) and what its routers may move.
"""

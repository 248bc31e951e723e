"""Training: the trainer and its named parts (optimizer and schedule, validation, early stop,
the journal of attempts, the sharded engine's ranks and meshes). Imports the model and the
checkpoint store; nothing of SQL, Hugging Face conversion or evaluation."""

"""Training data, one job per module:

- sources.py: documents from every corpus source (stdlib, text files and folders, JSONL,
  JSON/Parquet through `datasets`, a hub id), with what was skipped and why;
- tokenizer.py: training, loading and using the tokenizer (its special tokens);
- tokens.py: the streaming token writer and store, the pretraining sampler (a pure function
  of seed and step), SFT batches and replay mixes.
"""

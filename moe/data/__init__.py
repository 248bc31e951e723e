"""Training data: documents from every corpus source, the tokenizer, token stores and the
batches drawn from them (pretraining windows, SFT examples, replay mixes)."""

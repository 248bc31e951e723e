"""Hugging Face interop: reading a checkpoint's config, its safetensors weights, import into
our model, export back to the family it came from, and our own model folder format."""

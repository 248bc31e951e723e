"""Hugging Face architecture families, one module each behind one protocol: `Family`
(protocol.py) says how a family's config.json maps to our configuration, how its tensor names
map to ours and back, what it refuses, and how a model is exported to it. registry.py maps
config.json's model_type to its family: adding a family is one module and one registry line.

- qwen3_moe.py, qwen2_moe.py, mixtral.py, olmoe.py, ernie4_5_moe.py: MoE architectures,
  imported as they are and exported to;
- dense.py: Llama, Qwen2 and Qwen3, imported by upcycling (never exported to)."""

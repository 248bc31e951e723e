"""The MoE transformer. Imports nothing of training, checkpoints, data, SQL or Hugging Face.

- transformer.py: the decoder (attention, rotary positions, dense and MoE blocks, generation);
- routing.py: the router and every load-balancing method; experts.py: the grouped experts;
- rope.py: RoPE frequencies, YaRN's among them; masking.py: sliding windows and attention
  sinks (gpt-oss);
- buffers.py: what a model built on the meta device lacks once it has storage;
- growth.py: expert growth and pruning while training; stats.py: routing statistics;
- lora.py: LoRA adapters (projections, and the routed experts' 3-D adapters), the router
  policy, merging; quant.py: QLoRA's NF4 base (torchao).
"""

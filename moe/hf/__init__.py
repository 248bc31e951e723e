"""Hugging Face interop: checkpoints in from transformers, our models out to it, and our own
model folder format. One job per module:

- architecture.py: reading config.json; `Architecture`, `read_architecture`; the refusal of
  fields we cannot honour;
- families/: one module per architecture family (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
  ERNIE-4.5-MoE, gpt-oss, dense Llama/Qwen2/Qwen3 upcycled) behind one protocol
  (families/protocol.py `Family`), and the registry from model_type to family
  (families/registry.py);
- safetensors_io.py: a checkpoint's shard files, the lazy `Shards` reader,
  `StreamingSafetensors`, writing weight shards;
- importer.py: `load_hf_model`, `stream_hf_weights`, `import_model` (`model import`);
- exporter.py: `export_plan`, `hf_config`, `hf_tensors`, `export_hf` (`model export`);
- model_dir.py: our model folder (model.safetensors + model.json): save, read, skeleton;
  a LoRA stage's adapter.safetensors + adapter.json beside it;
- peft_adapter.py: a LoRA stage's adapters as a PEFT adapter folder (`model export`);
- model_init.py: `model.init` for training (`init_architecture`, `build_init_model`,
  `init_model_skeleton`);
- tokenizer_files.py: the tokenizer files that travel with a model;
- errors.py: `refuse`, the InputError naming the file at fault.
"""

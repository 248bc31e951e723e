"""LoRA and QLoRA, in one package (as PEFT keeps them in `tuners/lora/`):

- `lora.py`: the layers (a projection's adapters per output segment, the routed experts'
  adapters computed by the experts' grouped products), their injection into a model, the
  router policy, the merge;
- `nf4.py`: QLoRA's frozen base in NF4 (torchao) and the products over it;
- `method.py`: what a stage's `method` (full, lora, qlora) does to the model it loads, and
  the dtype LoRA holds its frozen base in;
- `files.py`: the adapters beside a stage's merged model, with the base's digest;
- `peft.py`: the PEFT folder `model export` writes, and what PEFT cannot carry.

The configuration is `moe.adapters.config.LoraConfig` (`<stage>.lora`). Nothing is imported here:
the model's own modules stand below this package, and a module of it is imported by name.
"""
